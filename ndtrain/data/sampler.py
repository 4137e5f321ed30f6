"""Layout-independent batch sampling: the global batch at a step is the same whatever the dp degree.

One global stream of sequence indices: epoch ``e`` is ``torch.randperm(N)`` seeded from
``(seed, e)``; global batch ``s`` is items ``[s*G, (s+1)*G)``, each dp rank taking a contiguous
slice. The state is ``consumed`` alone, so a run resumes on another dp degree, or global batch
size, and continues the same stream."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch); independent streams for distinct pairs."""
    digest = hashlib.sha256(f"ndtrain-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def local_slice(global_indices: Sequence[int], dp_rank: int, dp_size: int) -> list[int]:
    """Rank ``dp_rank``'s items ``[r*G/dp, (r+1)*G/dp)``. Raises ValueError if G % dp_size or the rank is
    off."""
    g = len(global_indices)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size={dp_size})")
    if g % dp_size:
        raise ValueError(f"global batch of {g} sequences is not divisible by dp_size ({dp_size})")
    n = g // dp_size
    return list(global_indices[dp_rank * n:(dp_rank + 1) * n])


class GlobalBatchSampler:
    """Reshardable, resumable sampler of global batches: indices in ``[0, num_sequences)``,
    ``global_batch_size`` G >= 1 (may exceed N: a batch then spans epochs), ``seed`` picks the stream."""

    def __init__(self, num_sequences: int, global_batch_size: int, seed: int = 0):
        if num_sequences < 1:
            raise ValueError(f"num_sequences ({num_sequences}) must be >= 1: the split is shorter "
                             f"than one sequence (lower data.seq_len or use a larger corpus)")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be >= 1")
        self.num_sequences = int(num_sequences)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.consumed = 0
        self._perms: dict[int, list[int]] = {}

    @property
    def step(self) -> int:
        """Global batches consumed so far at the current batch size."""
        return self.consumed // self.global_batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next stream item."""
        return self.consumed // self.num_sequences

    def permutation(self, epoch: int) -> list[int]:
        """The order of epoch ``epoch``: a permutation of ``range(num_sequences)``."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch touches at most two epochs unless G > N
                self._perms.pop(min(self._perms))
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perms[epoch] = torch.randperm(self.num_sequences, generator=gen).tolist()
        return self._perms[epoch]

    def stream(self, start: int, count: int) -> list[int]:
        """Stream items ``[start, start + count)`` (no state change)."""
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, off = divmod(pos, self.num_sequences)
            take = min(end - pos, self.num_sequences - off)
            out += self.permutation(epoch)[off:off + take]
            pos += take
        return out

    def peek(self, step: int) -> list[int]:
        """Global batch ``step``: stream items ``[step*G, (step+1)*G)`` (no state change)."""
        return self.stream(step * self.global_batch_size, self.global_batch_size)

    def next_global(self) -> list[int]:
        """The next G stream items; advances ``consumed`` by G."""
        batch = self.stream(self.consumed, self.global_batch_size)
        self.consumed += self.global_batch_size
        return batch

    def next_local(self, dp_rank: int, dp_size: int) -> list[int]:
        """``local_slice(next_global(), dp_rank, dp_size)``; every rank must call it each step."""
        return local_slice(self.next_global(), dp_rank, dp_size)

    local_slice = staticmethod(local_slice)

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, sd: dict) -> None:
        """Continue ``sd``'s stream (its ``consumed`` and ``seed``); this sampler keeps its own G."""
        consumed = int(sd["consumed"])
        if consumed < 0:
            raise ValueError(f"consumed ({consumed}) must be >= 0")
        if int(sd["seed"]) != self.seed:
            self._perms.clear()
        self.consumed, self.seed = consumed, int(sd["seed"])


def val_batches(num_sequences: int, global_batch_size: int, num_batches: int | None = None,
                dp_rank: int = 0, dp_size: int = 1) -> Iterator[list[int]]:
    """Validation order: sequences 0, 1, 2, ... unshuffled, in global batches of G sliced for
    ``dp_rank``; ``num_batches`` of them (None: ``max(1, N // G)``), wrapping modulo N. Raises
    ValueError if ``num_sequences < 1`` or G % dp_size."""
    if num_sequences < 1:
        raise ValueError(f"validation split has no sequence (num_sequences={num_sequences}); "
                         f"lower data.seq_len or raise data.val_fraction")
    g = global_batch_size
    total = num_batches if num_batches is not None else max(1, num_sequences // g)
    for b in range(total):
        batch = [(b * g + i) % num_sequences for i in range(g)]
        yield local_slice(batch, dp_rank, dp_size)
