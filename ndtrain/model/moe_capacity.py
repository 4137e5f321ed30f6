"""Expert capacity (token dropping) and the sequence-sharding description that makes MoE statistics
independent of the layout.

Capacity (GShard, Lepikhin 2020; Switch Transformer, Fedus 2021): within one *microbatch* of B
sequences of T tokens, expert e accepts at most ``capacity = ceil(cf * B T k / E)`` of the B T k
(token, slot) assignments. Priority is GShard's: every first choice before any second choice, and
within a slot, tokens in (sequence, position) order. An assignment is kept iff the number of
higher-priority assignments to the same expert in the microbatch is below the capacity.

Under context parallel a rank holds only some chunks of each sequence, so its own assignments are
not enough to rank a token. ``SequenceShards`` (installed by parallel code on every MoE layer as
``MoE.seq_shards``; the model never imports ``ndtrain.parallel``) says which chunks each rank
holds. Every rank counts its assignments per (slot, sequence, chunk, expert) block, one all-gather
of those counts gives the whole microbatch's block counts, and the rank of an assignment is the
number of same-expert assignments in all earlier blocks (prefix sum in priority order) plus those
before it in its own block. This is integer arithmetic on the same set of assignments, so the kept
set equals the single-process decision bit for bit; it costs one all-gather of k * B * chunks * E
int64 per MoE layer and forward instead of gathering the B T k routing decisions.

A token mask (``valid``: the MTP depths' padded tail under sequence / context parallel, see
``ndtrain.model.moe``) removes tokens from the microbatch before any of this: they add to no block
count, and the capacity is taken over the valid tokens, so the decision equals the single process's
on the truncated (B, T - k) sequences.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SequenceShards:
    """How the tokens of each sequence of a microbatch are spread over the ranks that share it
    (the ``cp`` group): every sequence is cut into ``n_chunks`` equal chunks, rank r holds chunks
    ``chunks[r]`` (global chunk indices, in the order its local tokens are stored).

    ``all_reduce(t)`` sums ``t`` over those ranks in place and returns it; ``all_gather(t)`` returns
    (size, *t.shape), rank order. Neither takes part in autograd (counts carry no gradient).
    """

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
    """For each entry of ``slot_major`` (M,) expert ids: how many earlier entries chose the same
    expert. (M,) int64."""
    order = torch.argsort(slot_major, stable=True)
    counts = torch.bincount(slot_major, minlength=n_experts)  # (E,)
    starts = torch.cumsum(counts, 0) - counts  # (E,)
    rank = torch.empty_like(slot_major)
    rank[order] = torch.arange(slot_major.numel(), device=slot_major.device) - starts[slot_major[order]]
    return rank


def capacity_keep(idx: torch.Tensor, shape: tuple[int, int], n_experts: int, capacity_factor: float,
                  shards: SequenceShards | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Which assignments fit the expert capacity of the microbatch (module docstring).

    Args:
        idx: (N, k) int64 expert ids of this rank's N = B * T_local tokens, (sequence, position)
            order, slot j = the j-th choice.
        shape: (B, T_local).
        n_experts: E.
        capacity_factor: cf > 0.
        shards: None (this rank holds whole sequences) or the cp sharding of the sequences; then
            T = T_local * shards.size and T_local must split into ``len(shards.local)`` chunks.
        valid: None (every token routes) or (N,) bool: tokens outside the microbatch's routed set
            (MTP's padded tail). They take no capacity and do not count in it: the capacity is
            ``ceil(cf * N_valid k / E)`` over the microbatch's valid tokens (summed over the shards)
            and a valid assignment's rank counts valid assignments only, as if the invalid tokens
            had been cut out of the microbatch. Their entries of ``keep`` are False.
    Returns: keep (N, k) bool, equal to the single-process decision on the whole microbatch.
    """
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
    """Turn ranks among this rank's assignments into ranks in the whole microbatch (module
    docstring): one all-gather of the (slot, sequence, chunk, expert) block counts. ``experts`` =
    (E, columns): ``slot_major`` (k*N,) ids are < columns, and ids >= E (the sentinel of invalid
    tokens) are not counted. Returns the ranks (k*N,) and the number of counted assignments of the
    whole microbatch."""
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
