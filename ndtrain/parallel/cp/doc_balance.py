"""Work-balanced context parallel for packed documents (``parallel.cp_doc_balance``).

Block-causal attention gives a query at offset j of its document j + 1 keys, so a document of n
tokens costs n (n + 1) / 2 and equal token counts are not equal work: the mirror layout (rank i holds
chunks i and 2cp-1-i) balances one causal sequence, not a row of documents. Per batch, the rows'
work per position is summed (one assignment serves every row: the ring's positions are shared by the
batch), the sequence cut into k cp equal chunks (k in 2, 4, 8 where T allows) and the chunks dealt,
heaviest first, to the lightest rank still short of k chunks (longest-processing-time with equal
counts, Graham 1969); the mirror layout is a candidate too and the assignment with the least work on
the busiest rank wins (ties: the earlier candidate), so it is never worse than the mirror. Only who
computes which token changes: the loss is a sum over the same tokens. Deterministic: every cp rank
holds the same documents and computes the same assignment, without communication."""
from __future__ import annotations

import torch

from ndtrain.model.documents import document_positions
from ndtrain.parallel.cp.context_parallel import local_positions

CHUNKS_PER_RANK = (2, 4, 8)


def position_work(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (T,) int64 keys each position's queries see, summed over rows (offset in the
    document + 1)."""
    return (document_positions(documents) + 1).sum(0)


def rank_work(work: torch.Tensor, assignment: torch.Tensor) -> torch.Tensor:
    """(T,) work, (cp, T/cp) positions -> (cp,) work per rank."""
    return work[assignment].sum(1)


def deal_chunks(work: torch.Tensor, cp: int, k: int) -> torch.Tensor:
    """(T,) work -> (cp, T/cp) positions: k cp equal chunks, heaviest first to the lightest rank with
    fewer than k (ties: lower chunk, lower rank), each rank's positions ascending. Raises ValueError
    when T is not divisible by k cp."""
    t = work.numel()
    if t % (k * cp):
        raise ValueError(f"seq_len ({t}) is not divisible by {k * cp} chunks")
    c = t // (k * cp)
    chunk_work = work.view(k * cp, c).sum(1).tolist()
    order = sorted(range(k * cp), key=lambda i: (-chunk_work[i], i))
    load, held = [0] * cp, [[] for _ in range(cp)]
    for i in order:
        r = min((r for r in range(cp) if len(held[r]) < k), key=lambda r: (load[r], r))
        held[r].append(i)
        load[r] += chunk_work[i]
    return torch.stack([torch.cat([torch.arange(i * c, (i + 1) * c) for i in sorted(h)]) for h in held])


def balanced_assignment(documents: torch.Tensor, cp: int) -> torch.Tensor:
    """(B, T) ids -> (cp, T/cp) int64 positions of every cp rank: the candidate (mirror layout, then
    ``deal_chunks`` for each k) with the least work on its busiest rank."""
    work = position_work(documents.cpu())
    t = work.numel()
    best = torch.stack([local_positions(t, cp, r, "load_balanced") for r in range(cp)])
    best_max = int(rank_work(work, best).max())
    for k in CHUNKS_PER_RANK:
        if t % (k * cp) == 0:
            cand = deal_chunks(work, cp, k)
            m = int(rank_work(work, cand).max())
            if m < best_max:
                best, best_max = cand, m
    return best


def imbalance(work: torch.Tensor, assignment: torch.Tensor) -> float:
    """max / mean work per rank (1.0 = balanced)."""
    w = rank_work(work, assignment).double()
    return float(w.max() / w.mean())


class WorkBalance:
    """The current batch's assignment, shared by the batch cut (``assign``) and the ring / hybrid cores
    (called as ``(cp, T) -> (cp, T/cp)`` positions); before any batch with documents, the mirror layout."""

    def __init__(self, cp: int):
        self.cp, self.current = cp, None

    def assign(self, documents: torch.Tensor) -> torch.Tensor:
        """(B, T) ids of this step's local batch -> (cp, T/cp) positions, kept for the cores."""
        self.current = balanced_assignment(documents, self.cp).to(documents.device)
        return self.current

    def __call__(self, cp: int, t: int) -> torch.Tensor:
        if self.current is not None and self.current.numel() == t:
            return self.current
        return torch.stack([local_positions(t, cp, r, "load_balanced") for r in range(cp)])
