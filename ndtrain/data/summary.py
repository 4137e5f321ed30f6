"""What a run trains on, in numbers: ``data_summary(data, cfg)`` (written to the run directory as
``data_summary.json`` and printed in the start-up summary).

``bytes_read`` is the UTF-8 size of the text the corpus source yields under ``data.max_corpus_bytes``
(what was tokenized); ``truncated`` says whether the cap cut the corpus. Both come from one pass
over the source's documents (no tokenization), stopping one byte past the cap, and are cached in the
prepared data folder (``corpus_bytes.json``; its key already covers the corpus and the cap), so only
the first run on a corpus pays for the pass.
"""
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
    """(bytes read, truncated) of ``cfg.source`` under ``cfg.max_corpus_bytes`` (0 = no cap).

    Raises ValueError as ``iter_documents`` (unreadable or missing source)."""
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
    """The corpus of a run: ``source``, ``tokenizer`` (the ``data.tokenizer`` setting),
    ``vocab_size`` (tokenizer ids), ``eos_id``, ``bytes_read``, ``truncated``, ``train_tokens``,
    ``val_tokens``, ``epochs`` = tokens the run consumes (steps x global_batch_size x seq_len) /
    train_tokens.

    Args: ``data``: the prepared ``TokenData``; ``cfg``: the run's config.
    Raises ValueError when the source cannot be read (see ``iter_documents``)."""
    meta = data.meta
    n_bytes, truncated = _cached_corpus_bytes(data, cfg.data)
    t = cfg.training
    train_tokens = int(meta["num_tokens"]["train"])
    consumed = t.steps * t.global_batch_size * cfg.data.seq_len
    return {"source": cfg.data.source, "tokenizer": cfg.data.tokenizer,
            "vocab_size": int(meta["tokenizer_vocab_size"]), "eos_id": int(meta["eos_id"]),
            "bytes_read": n_bytes, "truncated": truncated, "train_tokens": train_tokens,
            "val_tokens": int(meta["num_tokens"]["val"]), "epochs": consumed / max(train_tokens, 1)}
