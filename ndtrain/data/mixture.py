"""Weighted mixtures: global stream position -> (source, window), a pure function of the seed.

The stream is cut into blocks of B positions. Block ``b`` holds exactly
``A_s(b+1) - A_s(b)`` windows of source ``s``, where ``A_s(b) = floor(b*B*C_s) - floor(b*B*C_{s-1})``
and ``C_s`` is the cumulative weight; so after any whole block each source's share is within
``2 / (b*B)`` of its weight (B is at least ``2 / min weight``, which keeps every quota >= 0). Inside
a block the order is seeded jittered strata (source s's j-th window at time ``(j + U) / q_s``), so a
prefix of a block is near the weights too. The k-th window drawn from a source is item k of its
own epoch-shuffled stream (train) or window ``k mod N`` (validation). Nothing depends on the dp
degree, world size or microbatching, and the state is the number of positions consumed
(``MixtureSampler``, the ``GlobalBatchSampler`` contract), so a run resumes and reshards exactly.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ndtrain.data.pretokenized import open_streams
from ndtrain.data.sampler import GlobalBatchSampler

MIN_BLOCK = 1024


def _seed(*parts) -> int:
    digest = hashlib.sha256(("ndtrain-mixture:" + ":".join(map(str, parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class MixturePlan:
    """Which source and which of its draws each stream position is, for ``weights`` (sum 1)."""

    def __init__(self, weights: Sequence[float], seed: int, salt: str = "train"):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not len(w) or np.any(w <= 0):
            raise ValueError(f"mixture weights must be > 0, got {list(weights)}")
        self.weights = w / w.sum()
        self.cum = np.cumsum(self.weights)
        self.cum[-1] = 1.0  # exact: the last boundary is the whole block
        self.block = max(MIN_BLOCK, math.ceil(2.0 / self.weights.min()))
        self.seed, self.salt = int(seed), salt
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def before(self, b: int) -> np.ndarray:
        """``A(b)``: windows of each source in blocks ``[0, b)``, int64 (S,)."""
        edges = np.floor(b * self.block * self.cum).astype(np.int64)
        return np.diff(np.concatenate([[0], edges]))

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number) of each position of block ``b``: two int64 (B,)."""
        if b in self._cache:
            self._cache.move_to_end(b)
            return self._cache[b]
        quota = self.before(b + 1) - self.before(b)
        rng = np.random.default_rng(_seed(self.seed, self.salt, b))
        # jittered strata: source s's j-th window of the block sits at time (j + U) / q_s, U ~ [0, 1),
        # so every prefix of the block holds each source's share to about one window
        times = np.concatenate([(np.arange(q) + rng.random(q)) / q for q in quota if q])
        src = np.repeat(np.arange(len(quota)), quota)[np.argsort(times, kind="stable")]
        draw = np.empty(self.block, dtype=np.int64)
        start = self.before(b)
        for s in range(len(quota)):
            at = src == s
            draw[at] = start[s] + np.arange(int(at.sum()))
        self._cache[b] = (src, draw)
        if len(self._cache) > 4:
            self._cache.popitem(last=False)
        return src, draw

    def locate(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number) of each stream position: two int64 arrays like ``positions``."""
        pos = np.asarray(positions, dtype=np.int64)
        src, draw = np.empty_like(pos), np.empty_like(pos)
        blocks, offs = np.divmod(pos, self.block)
        for b in np.unique(blocks):
            at = blocks == b
            s, d = self._block(int(b))
            src[at], draw[at] = s[offs[at]], d[offs[at]]
        return src, draw

    def seen(self, consumed: int) -> np.ndarray:
        """Windows of each source in positions ``[0, consumed)``, int64 (S,)."""
        b, off = divmod(int(consumed), self.block)
        counts = self.before(b)
        if off:
            counts = counts + np.bincount(self._block(b)[0][:off], minlength=len(counts))
        return counts


class MixtureSampler(GlobalBatchSampler):
    """``GlobalBatchSampler`` whose stream is the positions themselves: item j is position j (the
    mixture, ``MixtureData``, maps it). State ``consumed``, as for the single-source sampler."""

    def stream(self, start: int, count: int) -> list[int]:
        return list(range(start, start + count))


class MixtureData:
    """The ``TokenData`` interface over a mixture folder (``mixture.json``, from ``prepare_mixture``):
    ``get(split, positions, T)`` -> ``(inputs, labels, documents)`` (documents None unless
    ``document_mask``), ``num_sequences``, ``num_tokens``, ``meta``, ``tokenizer``, ``log_fields``."""

    def __init__(self, path: str | Path, seed: int = 0, document_mask: bool = False):
        self.path = Path(path)
        self.meta: dict = json.loads((self.path / "mixture.json").read_text())
        self.sources = self.meta["sources"]
        self.names = [s["name"] for s in self.sources]
        self.streams = [open_streams(s, self.meta["val_fraction"]) for s in self.sources]
        w = [s["weight"] for s in self.sources]
        self.plans = {"train": MixturePlan(w, seed, "train"), "val": MixturePlan(w, seed, "val")}
        self.seed, self.document_mask = int(seed), document_mask
        self._perms: dict[tuple[int, int, int], np.ndarray] = {}

    def num_tokens(self, split: str) -> int:
        return sum(len(st[split].tokens) for st in self.streams)

    def num_sequences(self, split: str, seq_len: int) -> int:
        """Windows of all sources together (an epoch of the mixture, for the start-up summary);
        0 when any source has none (it could never be drawn)."""
        counts = [st[split].num_sequences(seq_len) for st in self.streams]
        return 0 if min(counts) < 1 else sum(counts)

    def _window(self, split: str, s: int, draws: np.ndarray, seq_len: int) -> np.ndarray:
        n = self.streams[s][split].num_sequences(seq_len)
        if n < 1:
            raise ValueError(f"source {self.names[s]}: its {split} split has no window of {seq_len + 1} tokens")
        if split == "val":
            return draws % n
        out = np.empty_like(draws)
        epochs, offs = np.divmod(draws, n)
        for e in np.unique(epochs):
            key = (s, int(e), n)
            if key not in self._perms:
                if len(self._perms) >= 2 * len(self.sources):
                    self._perms.pop(next(iter(self._perms)))
                rng = np.random.default_rng(_seed(self.seed, "source", self.names[s], int(e)))
                self._perms[key] = rng.permutation(n)
            at = epochs == e
            out[at] = self._perms[key][offs[at]]
        return out

    def locate(self, split: str, positions: Sequence[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window index in that source's split) of each position."""
        src, draw = self.plans[split].locate(positions)
        win = np.empty_like(draw)
        for s in np.unique(src):
            at = src == s
            win[at] = self._window(split, int(s), draw[at], seq_len)
        return src, win

    def get(self, split: str, positions: Sequence[int], seq_len: int):
        """Windows at stream ``positions``: inputs / labels int64 (n, T), documents int32 (n, T) or None."""
        src, win = self.locate(split, positions, seq_len)
        vocab = self.meta.get("model_vocab_size")
        tokens = np.empty((len(src), seq_len + 1), dtype=np.int64)
        docs = np.empty((len(src), seq_len), dtype=np.int32)
        for s in np.unique(src):  # numpy gathers: torch indexing of small tensors is slower here
            at = np.flatnonzero(src == s)
            tokens[at], docs[at] = self.streams[s][split].windows_np(win[at], seq_len, vocab)
        t = torch.from_numpy(tokens)
        return (t[:, :-1].contiguous(), t[:, 1:].contiguous(),
                torch.from_numpy(docs) if self.document_mask else None)

    def log_fields(self, consumed: int) -> dict[str, float]:
        """``data_share_<name>``: each source's share of the training tokens seen in ``[0, consumed)``."""
        counts = self.plans["train"].seen(consumed)
        total = max(1, int(counts.sum()))
        return {f"data_share_{n}": int(c) / total for n, c in zip(self.names, counts)}

    @property
    def tokenizer(self):
        from ndtrain.data.tokenizer import open_tokenizer

        tok = open_tokenizer(self.meta["tokenizer"], eos_id=self.meta["eos_id"])
        tok.eos_id = int(self.meta["eos_id"])
        return tok

    @property
    def description(self) -> str:
        """``mixture docs 70% + code 30%`` (the start-up summary's source)."""
        return "mixture " + " + ".join(f"{s['name']} {100 * s['weight']:.4g}%" for s in self.sources)

    def __repr__(self) -> str:
        return f"MixtureData({str(self.path)!r}, sources={self.names})"


def _max_token(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    """The largest id of a (memory-mapped) token array, read in chunks of ``chunk`` ids (-1 if empty)."""
    return max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


def prepare_mixture(cfg, vocab_size: int) -> Path:
    """Resolve ``cfg.sources`` (tokenizing text and hf sources into the cache) and write
    ``<cache>/mixtures/<key>/mixture.json``; return that folder. Raises ValueError from the sources,
    or naming a source with a split shorter than one sequence of ``cfg.seq_len + 1`` tokens."""
    from ndtrain.data.sources import mixture_key, parse_sources, resolve
    from ndtrain.data.tokenizer import cache_root, load_tokenizer

    if getattr(cfg, "format", "text") != "text":
        raise ValueError(f"data.sources mixes text and token sources; data.format={cfg.format} reads one "
                         "data.source (leave data.sources empty)")
    specs = parse_sources(cfg.sources)
    tok = load_tokenizer(cfg, vocab_size)
    resolved = [resolve(s, cfg, tok.spec, vocab_size) for s in specs]
    meta = {"sources": resolved, "val_fraction": cfg.val_fraction, "tokenizer": tok.spec,
            "eos_id": tok.eos_id, "tokenizer_vocab_size": tok.vocab_size, "model_vocab_size": vocab_size}
    folder = cache_root(cfg) / "mixtures" / mixture_key(resolved, {k: meta[k] for k in meta if k != "sources"})
    folder.mkdir(parents=True, exist_ok=True)
    streams = [open_streams(s, cfg.val_fraction) for s in resolved]
    for entry, st in zip(resolved, streams):
        for split in ("train", "val"):
            top = _max_token(st[split].tokens)
            if top >= vocab_size:  # before any rank starts, not at the first batch that holds it
                raise ValueError(f"source {entry['name']}: token id {top} >= model.vocab_size ({vocab_size})")
            if st[split].num_sequences(cfg.seq_len) < 1:
                raise ValueError(f"source {entry['name']}: the {split} split has {len(st[split].tokens)} tokens, "
                                 f"fewer than one sequence of data.seq_len + 1 ({cfg.seq_len + 1})")
    meta["num_tokens"] = {sp: sum(len(st[sp].tokens) for st in streams) for sp in ("train", "val")}
    meta["dtype"] = "mixture"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, folder / "mixture.json")
    (folder / "corpus_bytes.json").write_text(json.dumps({"bytes_read": 0, "truncated": False}))
    return folder


def open_training_data(cfg, data_path: str | Path):
    """(data, sampler) of a run: a mixture folder gives ``MixtureData`` + ``MixtureSampler``, a token
    shard or chat folder ``TokenData`` / ``ChatData`` (``ndtrain.data.chat.open_data``) +
    ``GlobalBatchSampler``."""
    from ndtrain.data.chat import open_data

    t, T = cfg.training, cfg.data.seq_len
    documents = bool(getattr(cfg.data, "document_mask", False))
    if (Path(data_path) / "mixture.json").is_file():
        data = MixtureData(data_path, t.seed, documents)
        return data, MixtureSampler(max(1, data.num_sequences("train", T)), t.global_batch_size, t.seed)
    data = open_data(data_path, documents)
    return data, GlobalBatchSampler(data.num_sequences("train", T), t.global_batch_size, t.seed)
