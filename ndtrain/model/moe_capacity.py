"""Expert capacity (token dropping) that does not depend on the layout.

Capacity (GShard, Lepikhin 2020; Switch, Fedus 2021): per microbatch of B x T tokens, expert e
keeps at most ``ceil(cf * B T k / E)`` assignments; priority: every first choice before any second,
then (sequence, position) order. Under cp a rank holds only some chunks of each sequence
(``SequenceShards``, installed by parallel code as ``MoE.seq_shards``): block counts per (slot,
sequence, chunk, expert) are all-gathered (k * B * chunks * E int64 per layer and forward) and
prefix-summed, so the kept set equals the single process's bit for bit. Masked tokens
(``valid``) count nowhere; capacity is taken over the valid tokens."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SequenceShards:
    """How the cp ranks share each sequence: ``n_chunks`` equal chunks, rank r holds ``chunks[r]``
    (global indices, local order). ``all_reduce`` (in place) and ``all_gather`` ((size, *shape))
    take no part in autograd."""

    rank: int
    chunks: tuple[tuple[int, ...], ...]
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def n_chunks(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def local(self) -> tuple[int, ...]:
        return self.chunks[self.rank]


def _rank_in_expert(slot_major: torch.Tensor, n_experts: int) -> torch.Tensor:
    """For each of ``slot_major`` (M,) expert ids: earlier entries with the same expert, (M,) int64."""
    order = torch.argsort(slot_major, stable=True)
    counts = torch.bincount(slot_major, minlength=n_experts)  # (E,)
    starts = torch.cumsum(counts, 0) - counts  # (E,)
    rank = torch.empty_like(slot_major)
    rank[order] = torch.arange(slot_major.numel(), device=slot_major.device) - starts[slot_major[order]]
    return rank


def capacity_keep(idx: torch.Tensor, shape: tuple[int, int], n_experts: int, capacity_factor: float,
                  shards: SequenceShards | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """keep (N, k) bool, the single-process decision on the whole microbatch.

    idx (N, k) int64 in (sequence, position) order, N = B * T_local; shape (B, T_local); shards: None
    or the cp sharding (T = T_local * shards.size); valid: None or (N,) bool, tokens that take no
    capacity (capacity ``ceil(cf * N_valid k / E)`` over the valid tokens) and are never kept."""
    n, k = idx.shape
    e = n_experts
    slot_major = idx.t().reshape(-1)  # (k*N,) priority order: slot, then sequence, then position
    if valid is not None:  # invalid tokens -> sentinel expert E, whose ranks are never read
        slot_major = slot_major.masked_fill(~valid.reshape(-1).repeat(k), e)
    cols = e + (valid is not None)
    rank = _rank_in_expert(slot_major, cols)  # among this rank's assignments
    n_valid = n if valid is None else int(valid.sum())  # tokens of this rank that route
    if shards is not None and shards.size > 1:
        rank, routed = _rank_over_shards(rank, slot_major, shape, k, (e, cols), shards)
        n_valid = n * shards.size if valid is None else routed // k
    if valid is None:  # (the historic expression, kept bit-identical for the unmasked layouts)
        cap = math.ceil(capacity_factor * n * (shards.size if shards else 1) * k / e)
    else:
        cap = math.ceil(capacity_factor * n_valid * k / e)
    keep = rank < cap
    if valid is not None:
        keep &= slot_major < e
    return keep.view(k, n).t()  # (N, k)


def _rank_over_shards(rank: torch.Tensor, slot_major: torch.Tensor, shape: tuple[int, int], k: int,
                      experts: tuple[int, int], shards: SequenceShards) -> tuple[torch.Tensor, int]:
    """Local ranks -> ranks in the whole microbatch via one all-gather of block counts. ``experts`` =
    (E, columns); ids >= E (invalid tokens' sentinel) are not counted. Returns (ranks (k*N,), counted)."""
    b, t = shape
    e, cols = experts
    nl, nc = len(shards.local), shards.n_chunks
    blocks = k * b * nl  # (slot, sequence, local chunk) blocks, in local priority order
    block = torch.arange(blocks, device=slot_major.device).repeat_interleave(t // nl)  # (k*N,)
    cnt = torch.bincount(block * cols + slot_major, minlength=blocks * cols).view(blocks, cols)[:, :e]  # (blocks, E)
    local_off = cnt.cumsum(0) - cnt  # same-expert assignments in earlier local blocks
    every = shards.all_gather(cnt.reshape(k, b, nl, e))  # (S, k, B, nl, E)
    full = cnt.new_zeros(k, b, nc, e)  # block counts of the whole microbatch, chunks in order
    for s, ids in enumerate(shards.chunks):
        full[:, :, list(ids)] = every[s]
    flat = full.view(-1, e)
    global_off = (flat.cumsum(0) - flat).view(k, b, nc, e)[:, :, list(shards.local)].reshape(blocks, e)
    shift = global_off - local_off  # (blocks, E)
    shift = torch.cat([shift, shift.new_zeros(blocks, 1)], dim=1)  # sentinel column: unchanged
    return rank + shift[block, slot_major.clamp(max=e)], int(flat.sum())


def balanced_assignment(shape: tuple[int, int], k: int, n_experts: int, shards: SequenceShards | None = None,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Forced-balanced routing for benchmarks (``training.moe_routing: balanced``): idx (N, k) int64,
    N = B * T_local, slot j of the token at sequence position p goes to expert ``(p k + j) mod E``.

    It reads only the position in the whole sequence (``shards``: the cp / tp split of each sequence,
    None = whole), never the rank or the microbatch, so every layout routes as one process; the k
    experts of a token are distinct (k <= E), and when E divides T k every expert gets exactly T k / E
    assignments of each sequence (so E / ep of every ep rank's share as well)."""
    b, t = shape
    if shards is None or shards.size == 1:
        pos = torch.arange(t, device=device)  # (T,)
    else:
        per = t // len(shards.local)  # tokens per chunk
        pos = torch.cat([c * per + torch.arange(per, device=device) for c in shards.local])  # (T_local,)
    idx = (pos.unsqueeze(1) * k + torch.arange(k, device=device)) % n_experts  # (T_local, k)
    return idx.expand(b, t, k).reshape(b * t, k)
