"""What a run trains on, in numbers (``data_summary.json``, the start-up summary). ``bytes_read`` and
``truncated`` come from one pass over the documents, cached in the prepared folder
(``corpus_bytes.json``), so only the first run on a corpus pays for it."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from ndtrain.config import Config, DataConfig
from ndtrain.data.corpus import iter_documents

_CACHE = "corpus_bytes.json"


def corpus_bytes(cfg: DataConfig) -> tuple[int, bool]:
    """(bytes read, truncated) under ``cfg.max_corpus_bytes`` (0 = no cap). Raises ValueError as
    ``iter_documents``."""
    cap = cfg.max_corpus_bytes
    total = 0
    for doc in iter_documents(dataclasses.replace(cfg, max_corpus_bytes=0)):
        total += len(doc.encode("utf-8"))
        if cap and total > cap:  # one byte past the cap is enough to know it cut the corpus
            return cap, True
    return total, False


def _cached_corpus_bytes(data, cfg: DataConfig) -> tuple[int, bool]:
    path = Path(data.path) / _CACHE
    try:
        saved = json.loads(path.read_text())
        return int(saved["bytes_read"]), bool(saved["truncated"])
    except (OSError, ValueError, KeyError):
        pass
    n, cut = corpus_bytes(cfg)
    try:  # the cache is an optimisation: a read-only data folder just means no cache
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"bytes_read": n, "truncated": cut}, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return n, cut


def data_summary(data, cfg: Config) -> dict:
    """``source``, ``tokenizer``, ``vocab_size``, ``eos_id``, ``bytes_read``, ``truncated``,
    ``train_tokens``, ``val_tokens``, ``epochs`` (steps x global_batch_size x seq_len / train_tokens).
    Raises ValueError when the source cannot be read."""
    meta = data.meta
    n_bytes, truncated = _cached_corpus_bytes(data, cfg.data)
    t = cfg.training
    train_tokens = int(meta["num_tokens"]["train"])
    consumed = t.steps * t.global_batch_size * cfg.data.seq_len
    return {"source": getattr(data, "description", cfg.data.source), "tokenizer": cfg.data.tokenizer,
            "vocab_size": int(meta["tokenizer_vocab_size"]), "eos_id": int(meta["eos_id"]),
            "bytes_read": n_bytes, "truncated": truncated, "train_tokens": train_tokens,
            "val_tokens": int(meta["num_tokens"]["val"]), "epochs": consumed / max(train_tokens, 1)}
