"""Named validation sets (``eval.sets``): each source tokenized once with the run's tokenizer into a
cached folder that ``TokenData`` reads, its whole stream as the ``val`` split (``train.bin`` empty).

A set whose source is ``val`` is the run's own held-out slice and needs no folder. Other sources are
read as ``data.source`` is (a path / glob / comma list; ``data.text_field``, no ``max_corpus_bytes``
cap) and cached under ``<cache>/evalsets/<key>/`` (key: the source's fingerprint and the tokenizer's
identity, as ``ndtrain.data.shards.shard_key``), published with one ``os.rename`` like the shards.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ndtrain.config import DataConfig
from ndtrain.data.corpus import source_fingerprint
from ndtrain.data.shards import FORMAT_VERSION, _doc_chunks, publish_folder, shard_key
from ndtrain.data.tokenizer import Tokenizer, cache_root

HELD_OUT = "val"  # the source naming the run's own validation split


def prepare_eval_set(cfg: DataConfig, source: str, tok: Tokenizer) -> Path | None:
    """The cached folder of eval set ``source`` tokenized by ``tok`` (the run's tokenizer), or None
    for ``"val"`` (the run's held-out split). A second call returns the same folder without
    tokenizing. Raises ValueError (unreadable source, as ``iter_documents``; fewer than 2 tokens)."""
    if source == HELD_OUT:
        return None
    sub = _one_source(cfg, source)
    fingerprint = source_fingerprint(sub)
    root = cache_root(cfg) / "evalsets"
    final = root / shard_key(sub, tok, fingerprint)

    def build(tmp: Path) -> dict:
        dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
        n_tokens, n_docs = 0, 0
        with open(tmp / "val.bin", "wb") as f:
            for chunk in _doc_chunks(sub):
                ids = tok.encode_docs(chunk)
                f.write(ids.astype(dtype).tobytes())
                n_tokens, n_docs = n_tokens + len(ids), n_docs + len(chunk)
        if n_tokens < 2:
            raise ValueError(f"eval set source {source!r} gives {n_tokens} tokens (need >= 2)")
        (tmp / "train.bin").write_bytes(b"")
        return {"dtype": np.dtype(dtype).name, "num_tokens": {"train": 0, "val": n_tokens},
                "num_documents": n_docs, "format_version": FORMAT_VERSION, "fingerprint": fingerprint,
                "tokenizer": tok.spec, "eos_id": tok.eos_id, "tokenizer_vocab_size": tok.vocab_size,
                "source": source, "text_field": cfg.text_field, "eval_set": True}

    return publish_folder(final, tok, build)


def _one_source(cfg: DataConfig, source: str) -> DataConfig:
    """``cfg`` reading ``source`` alone, uncapped: any other source setting (a mixture's list)
    back at its default, so the set is its own text and not the training corpus."""
    reset = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
             for f in dataclasses.fields(cfg) if f.name == "sources"}
    return dataclasses.replace(cfg, source=source, max_corpus_bytes=0, **reset)


def prepare_eval_sets(cfg, tok: Tokenizer) -> dict[str, Path | None]:
    """``{name: folder or None}`` for every ``cfg.eval.sets`` entry (``cfg``: a whole ``Config``),
    in order. Raises ValueError naming the set whose source failed, or whose stream holds less than
    one sequence of ``data.seq_len + 1`` tokens."""
    out = {}
    for name, source in cfg.eval.named_sets():
        try:
            out[name] = folder = prepare_eval_set(cfg.data, source, tok)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"eval.sets {name}: {e}") from None
        if folder is not None:
            n = json.loads((folder / "meta.json").read_text())["num_tokens"]["val"]
            if n < cfg.data.seq_len + 1:
                raise ValueError(f"eval.sets {name}: {source!r} gives {n} tokens, fewer than one "
                                 f"sequence of data.seq_len + 1 ({cfg.data.seq_len + 1})")
    return out
