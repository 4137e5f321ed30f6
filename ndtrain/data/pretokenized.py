"""One source's tokens as fixed-length windows with document ids, read by memory map.

A source is a flat token stream (its documents back to back) and the documents' boundaries: start
offsets (Megatron ``.idx``, an offsets ``.npy``) or an EOS id closing each document (the shards of
``ndtrain.data.shards``). Its last ``val_fraction`` of tokens is the validation split, as in the shards.
Window ``i`` of a split is tokens ``[i*T, i*T + T + 1)``: inputs its first T, labels its last T."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


class TokenStream:
    """``tokens`` (n,) ids of one split, ``doc_starts`` sorted offsets of document starts in it (or
    None: documents end at ``eos_id``; None too: one document), ``name`` for errors."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray | None, eos_id: int | None, name: str):
        self.tokens, self.doc_starts, self.eos_id, self.name = tokens, doc_starts, eos_id, name

    def num_sequences(self, seq_len: int) -> int:
        if seq_len < 1:
            raise ValueError(f"seq_len ({seq_len}) must be >= 1")
        return max(0, (len(self.tokens) - 1) // seq_len)

    def windows(self, idx: Sequence[int], seq_len: int, vocab_size: int | None = None):
        """``(inputs, labels, documents)`` of windows ``idx``: int64 (n, T), int64 (n, T), int32 (n, T)
        (0-based per row, a new id at each document start). Raises IndexError for a window outside
        the split, ValueError for a token id >= ``vocab_size``."""
        win, doc = self.windows_np(idx, seq_len, vocab_size)
        w = torch.from_numpy(win)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous(), torch.from_numpy(doc)

    def windows_np(self, idx: Sequence[int], seq_len: int, vocab_size: int | None = None):
        """numpy ``(tokens int64 (n, T + 1), documents int32 (n, T))`` of ``windows``."""
        idx = np.asarray(idx, dtype=np.int64)
        n_seq = self.num_sequences(seq_len)
        if idx.size and (idx.min() < 0 or idx.max() >= n_seq):
            raise IndexError(f"source {self.name}: window out of range [0, {n_seq}): {idx.min()}..{idx.max()}")
        pos = idx[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
        win = self.tokens[pos].astype(np.int64)
        if vocab_size is not None and win.size and int(win.max()) >= vocab_size:
            raise ValueError(f"source {self.name}: token id {int(win.max())} >= model.vocab_size ({vocab_size})")
        inp = pos[:, :-1]
        if self.doc_starts is not None:
            doc = np.searchsorted(self.doc_starts, inp, side="right")
        elif self.eos_id is not None:
            is_eos = win[:, :-1] == self.eos_id
            doc = np.cumsum(is_eos, axis=1) - is_eos  # the id moves on after each EOS
        else:
            doc = np.zeros_like(inp)
        return win, (doc - doc[:, :1]).astype(np.int32)


def split_bounds(n_tokens: int, val_fraction: float, name: str) -> tuple[int, int]:
    """(train tokens, val tokens): the val split is the last ``round(n * val_fraction)`` tokens.
    Raises ValueError when a split gets fewer than 2 tokens."""
    n_val = int(round(n_tokens * val_fraction))
    if n_val < 2 or n_tokens - n_val < 2:
        raise ValueError(f"source {name}: {n_tokens} tokens are too few to split off "
                         f"val_fraction={val_fraction} (need >= 2 tokens per split)")
    return n_tokens - n_val, n_val


def _flat(entry: dict) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """The whole source: (tokens memmap, doc starts or None, eos id or None)."""
    kind, path = entry["kind"], Path(entry["path"])
    if kind == "megatron":
        from ndtrain.data.megatron_index import MegatronIndex

        ix = MegatronIndex(path)
        return ix.tokens, ix.doc_starts(), None
    if kind == "shards":
        meta = json.loads((path / "meta.json").read_text())
        dt = np.dtype(meta["dtype"])
        parts = [np.memmap(path / f"{s}.bin", dtype=dt, mode="r") for s in ("train", "val")]
        return parts, None, int(meta["eos_id"])
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
            raise ValueError(f"{path}: token file must be 1-D integer, got {tokens.dtype} {tokens.shape}")
    else:
        tokens = np.memmap(path, dtype=np.dtype(entry["dtype"]), mode="r")
    starts = None
    if entry.get("offsets"):
        starts = np.load(entry["offsets"]).astype(np.int64)
        if starts.ndim != 1 or (starts.size and (np.any(np.diff(starts) < 0) or starts[0] < 0
                                                 or starts[-1] > len(tokens))):
            raise ValueError(f"{entry['offsets']}: document offsets must be 1-D, sorted, in [0, {len(tokens)}]")
    eos = entry.get("eos_id", -1)
    return tokens, starts, (eos if eos is not None and eos >= 0 else None)


def open_streams(entry: dict, val_fraction: float) -> dict[str, TokenStream]:
    """``{"train": TokenStream, "val": TokenStream}`` of a resolved source (``ndtrain.data.sources.resolve``)."""
    tokens, starts, eos = _flat(entry)
    name = entry["name"]
    if isinstance(tokens, list):  # prepared shards: already split
        return {s: TokenStream(t, None, eos, name) for s, t in zip(("train", "val"), tokens)}
    n_train, _ = split_bounds(len(tokens), val_fraction, name)
    out = {}
    for split, (a, b) in {"train": (0, n_train), "val": (n_train, len(tokens))}.items():
        rel = None
        if starts is not None:
            rel = starts[(starts > a) & (starts < b)] - a  # offset 0 starts a document by construction
        out[split] = TokenStream(tokens[a:b], rel, eos, name)
    return out
