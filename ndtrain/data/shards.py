"""Token shards: tokenize the corpus once into ``train.bin`` / ``val.bin`` memmaps, then serve windows.

Layout of a prepared folder ``<cache>/shards/<key>/`` (key = hash of corpus fingerprint, tokenizer,
vocab_size, val_fraction and the format version):

- ``train.bin``, ``val.bin``: flat token ids, numpy ``uint16`` when the tokenizer has <= 65535 ids
  else ``uint32``. Every document is followed by the EOS id; the validation split is the last
  ``val_fraction`` of the token stream.
- ``tokenizer.json``: a copy of the tokenizer file (absent for "bytes").
- ``meta.json``: dtype, token counts, tokenizer spec / eos id / vocab, fingerprint, config fields.

A folder is built in ``<cache>/shards/.tmp-*`` and published with one ``os.rename``: a crash leaves
no partial folder under the final name, and when two processes race the first rename wins and the
loser discards its copy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ndtrain.config import DataConfig
from ndtrain.data.corpus import iter_documents, source_fingerprint
from ndtrain.data.tokenizer import Tokenizer, cache_root, load_tokenizer, open_tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "val")
_CHUNK_CHARS = 1 << 20  # text handed to one encode_batch call
_CHUNK_DOCS = 2048


def _tokenizer_id(tok: Tokenizer) -> str:
    """Identity of a tokenizer for cache keys: content hash of its file, or its spec."""
    if tok.spec == "bytes":
        return "bytes"
    return "sha256:" + hashlib.sha256(Path(tok.spec).read_bytes()).hexdigest()


def shard_key(cfg: DataConfig, tok: Tokenizer, fingerprint: str) -> str:
    """16-hex-char cache key of a prepared folder."""
    key = {"v": FORMAT_VERSION, "fp": fingerprint, "tok": _tokenizer_id(tok), "eos": tok.eos_id,
           "vocab": tok.vocab_size, "val": cfg.val_fraction}
    if tok.bos_id is not None:  # documents start with the BOS (ndtrain.data.tokenizer): another stream
        key["bos"] = tok.bos_id
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _doc_chunks(cfg: DataConfig) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in iter_documents(cfg):
        chunk.append(doc)
        chars += len(doc)
        if chars >= _CHUNK_CHARS or len(chunk) >= _CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _write_shards(cfg: DataConfig, tok: Tokenizer, out: Path) -> dict:
    """Tokenize the corpus into ``out/train.bin`` and ``out/val.bin``; return token counts."""
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    train = out / "train.bin"
    n_tokens, n_docs = 0, 0
    with open(train, "wb") as f:
        for chunk in _doc_chunks(cfg):
            ids = tok.encode_docs(chunk)
            f.write(ids.astype(dtype).tobytes())
            n_tokens += len(ids)
            n_docs += len(chunk)
    n_val = int(round(n_tokens * cfg.val_fraction))
    n_train = n_tokens - n_val
    if n_val < 2 or n_train < 2:
        raise ValueError(f"corpus {cfg.source!r} gives {n_tokens} tokens: too few to split off "
                         f"val_fraction={cfg.val_fraction} (need >= 2 tokens per split)")
    itemsize = np.dtype(dtype).itemsize
    # the val split is the tail of the stream: copy it out, then cut it off train.bin in place
    tail = np.fromfile(train, dtype=dtype, count=n_val, offset=n_train * itemsize)
    tail.tofile(out / "val.bin")
    os.truncate(train, n_train * itemsize)
    return {"dtype": np.dtype(dtype).name, "num_tokens": {"train": n_train, "val": n_val},
            "num_documents": n_docs}


def prepare_data(cfg: DataConfig, vocab_size: int) -> Path:
    """Tokenize ``cfg.source`` once (cached) and return the folder holding the shards.

    Args:
        cfg: the data section; ``source``, ``tokenizer``, ``text_field``, ``max_corpus_bytes``,
            ``val_fraction`` and ``cache_dir`` matter here (``seq_len`` does not).
        vocab_size: the model's embedding rows; the tokenizer must fit (BPE is trained to it).
    Returns:
        ``<cache>/shards/<key>`` with ``train.bin``, ``val.bin``, ``meta.json``. A second call with
        an unchanged corpus returns the same folder without tokenizing.
    Raises:
        ValueError: from the corpus / tokenizer (see ``iter_documents``, ``load_tokenizer``), or a
            corpus too small to split.
    """
    fingerprint = source_fingerprint(cfg)
    tok = load_tokenizer(cfg, vocab_size)
    root = cache_root(cfg) / "shards"
    final = root / shard_key(cfg, tok, fingerprint)

    def build(tmp: Path) -> dict:
        t0 = time.perf_counter()
        meta = _write_shards(cfg, tok, tmp)
        meta.update(format_version=FORMAT_VERSION, fingerprint=fingerprint, tokenizer=tok.spec,
                    eos_id=tok.eos_id, tokenizer_vocab_size=tok.vocab_size, model_vocab_size=vocab_size,
                    source=cfg.source, text_field=cfg.text_field, val_fraction=cfg.val_fraction,
                    max_corpus_bytes=cfg.max_corpus_bytes,
                    prepare_seconds=round(time.perf_counter() - t0, 3))
        log.info("prepared %s tokens in %.1fs", meta["num_tokens"], meta["prepare_seconds"])
        return meta

    return publish_folder(final, tok, build)

def publish_folder(final: Path, tok: Tokenizer, build: Callable[[Path], dict]) -> Path:
    """The cached folder ``final``, built once: ``build(tmp)`` writes its files into a fresh
    ``final.parent/.tmp-*`` folder and returns its ``meta.json`` dict; a copy of the tokenizer file
    joins them (absent for "bytes") and the folder is published with one ``os.rename`` (module
    docstring: a crash leaves no partial folder; the loser of a race discards its copy). Returns
    ``final`` at once when it already holds ``meta.json``. Raises what ``build`` raises."""
    if (final / "meta.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        meta = build(tmp)
        if tok.spec != "bytes":  # keep a copy: the folder stays usable if the original moves
            shutil.copyfile(tok.spec, tmp / "tokenizer.json")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():  # not a lost race: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process published first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final

class TokenData:
    """Read-only view of a prepared folder: fixed-length training windows from the memmaps.

    Sequence ``i`` of a split is tokens ``[i*T, i*T + T + 1)`` (stride T, no overlap of inputs):
    inputs are its first T tokens, labels its last T (the next-token shift happens here, before any
    data / context-parallel sharding). ``document_mask`` (``data.document_mask``): ``get`` also
    numbers the packed documents (docs/packed_documents.md).
    """

    def __init__(self, path: str | Path, document_mask: bool = False):
        self.document_mask = document_mask
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{self.path} is not a prepared data folder (no meta.json)")
        self.meta: dict = json.loads(meta_path.read_text())
        self.dtype = np.dtype(self.meta["dtype"])
        self._mm: dict[str, np.memmap] = {}

    def tokens(self, split: str) -> np.ndarray:
        """The flat token memmap of ``split`` ("train" | "val"), shape (n_tokens,)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self._mm:
            self._mm[split] = np.memmap(self.path / f"{split}.bin", dtype=self.dtype, mode="r")
        return self._mm[split]

    def num_tokens(self, split: str) -> int:
        return int(self.meta["num_tokens"][split])

    def num_sequences(self, split: str, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens at stride ``seq_len``: ``(n_tokens - 1) // seq_len``."""
        if seq_len < 1:
            raise ValueError(f"seq_len ({seq_len}) must be >= 1")
        return max(0, (self.num_tokens(split) - 1) // seq_len)

    def get(self, split: str, indices: Sequence[int], seq_len: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sequences ``indices`` of ``split``.

        Returns:
            ``(inputs, labels, documents)``: inputs, labels LongTensor (n, T) with ``labels[:, t] ==
            inputs[:, t + 1]`` for t < T - 1, n = len(indices), T = seq_len; documents None, or with
            ``document_mask`` (n, T) int32 ids: 0 at t = 0, one more after each EOS input (each document
            is followed by its EOS in the stream, so the EOS belongs to the document it ends), and
            labels -100 at EOS inputs (their next token starts another document, which they cannot see).
        Raises:
            IndexError: an index outside ``[0, num_sequences(split, seq_len))``.
        """
        n_seq = self.num_sequences(split, seq_len)
        idx = np.asarray(list(indices), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n_seq):
            raise IndexError(f"sequence index out of range [0, {n_seq}) for split {split!r} "
                             f"with seq_len {seq_len}: {idx.min()}..{idx.max()}")
        offsets = idx[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # (n, T+1)
        windows = torch.from_numpy(self.tokens(split)[offsets].astype(np.int64))
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if not self.document_mask:
            return inputs, labels, None
        return (inputs,) + packed_documents(inputs, labels, int(self.meta["eos_id"]))

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the shards were made with: the folder's copy of its tokenizer.json (or the
        spec in meta.json), with the EOS id recorded at preparation."""
        local = self.path / "tokenizer.json"
        spec = str(local) if local.is_file() else self.meta["tokenizer"]
        tok = open_tokenizer(spec, eos_id=self.meta["eos_id"])
        tok.eos_id = int(self.meta["eos_id"])
        return tok

    def __repr__(self) -> str:
        return f"TokenData({str(self.path)!r}, tokens={self.meta['num_tokens']}, dtype={self.dtype})"


def packed_documents(inputs: torch.Tensor, labels: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) inputs / labels -> (labels with -100 at EOS inputs, (B, T) int32 document ids: the
    number of EOS inputs before each token)."""
    eos = inputs == eos_id
    documents = torch.zeros(inputs.shape, dtype=torch.int32)
    documents[:, 1:] = eos[:, :-1].cumsum(1, dtype=torch.int32)
    return labels.masked_fill(eos, -100), documents
