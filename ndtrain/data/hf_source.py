"""Hugging Face ``datasets`` sources: a ``load_from_disk`` folder or a data folder ``load_dataset``
reads (``streaming`` where the library streams it), tokenized once into a cached Megatron folder.

``field``: a text column (tokenized, each document followed by EOS) or ``tokens`` (lists of ids,
taken as they are: one document each). ``datasets`` is optional (``pip install 'ndtrain[datasets]'``)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


def _fingerprint(path: Path, extra: dict) -> str:
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        st = p.stat()
        h.update(f"\n{p.resolve()}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def open_dataset(path: Path, streaming: bool):
    """The ``train`` split (or the only one) of the dataset at ``path``."""
    import datasets

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))
    else:
        ds = datasets.load_dataset(str(path), streaming=streaming)
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    return ds


def prepare_hf(spec, cfg, tokenizer_spec: str, vocab_size: int) -> Path:
    """Tokenize ``spec`` (a ``SourceSpec`` of kind hf) into ``<cache>/hf/<key>/``; return the folder.
    Raises ValueError when ``datasets`` is missing, the path is not a folder, or the field is absent."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ValueError(f"data.sources {spec.name}: kind hf needs the datasets package "
                         "(pip install 'ndtrain[datasets]')") from None
    from ndtrain.data.prepare import tokenizer_id, write_token_documents
    from ndtrain.data.tokenizer import cache_root, open_tokenizer

    path = Path(spec.path).expanduser()
    if not path.is_dir():
        raise ValueError(f"data.sources {spec.name}: {path} is not a dataset folder")
    field = spec.field or cfg.text_field
    tok = open_tokenizer(tokenizer_spec, vocab_size, cfg.eos_id)
    ident = {"field": field, "tokenizer": tokenizer_id(tok.spec), "eos": tok.eos_id,
             "streaming": spec.streaming, "v": 1}
    out = cache_root(cfg) / "hf" / _fingerprint(path, ident)
    if (out / "manifest.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    ds = open_dataset(path, spec.streaming)

    def docs():
        for i, row in enumerate(ds):
            if field not in row:
                raise ValueError(f"data.sources {spec.name}: row {i} has no field {field!r}; "
                                 f"fields: {sorted(row)}")
            value = row[field]
            if field == "tokens":
                yield np.asarray(value, dtype=np.int64)
            elif value:
                yield np.append(np.asarray(tok.encode(value), dtype=np.int64), tok.eos_id)

    dtype = np.uint16 if max(tok.vocab_size, vocab_size) <= 65535 else np.int32
    write_token_documents(out, docs(), dtype, {**ident, "source": str(path)})
    return out
