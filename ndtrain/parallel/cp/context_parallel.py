"""Context parallel: every sample's sequence split over ``cp`` (docs/context_parallel.md).

Layouts (``parallel.cp_layout``): ``load_balanced`` (2*cp chunks, rank i holds i and 2*cp-1-i:
equal causal work; Liu et al. 2023, Llama 3) and ``contiguous`` (Ulysses and state / window
mixers). ``apply_cp`` gives each mixer its cp form; labels are shifted before ``shard_batch`` cuts
inputs, labels, positions and documents alike. Gradients are summed over ``dp_cp`` by the
data-parallel wrapper; this axis carries activations and their gradients only."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.mixer_spec import non_softmax_mixers
from ndtrain.model.documents import document_positions
from ndtrain.parallel import comm
from ndtrain.parallel.cp.ring import ring_attention
from ndtrain.parallel.cp.rules import CONTIGUOUS_MIXERS
from ndtrain.parallel.cp.state_passing import StatePasser
from ndtrain.parallel.cp.ulysses import ulysses_attention
from ndtrain.parallel.cp.window import WindowContextParallel

LAYOUTS = ("load_balanced", "contiguous")


def resolve_layout(impl: str, layout: str, mixers: tuple[str, ...] = ()) -> str:
    """``auto`` -> load_balanced for ring, contiguous for Ulysses or when ``mixers`` pass state or a
    window to the next rank (which need contiguous: ValueError otherwise)."""
    ordered = bool(set(mixers) & set(CONTIGUOUS_MIXERS))
    if layout == "auto":
        return "load_balanced" if impl in ("ring", "hybrid") and not ordered else "contiguous"
    if layout not in LAYOUTS:
        raise ValueError(f"cp layout ({layout}) must be auto|{'|'.join(LAYOUTS)}")
    if (impl == "ulysses" or ordered) and layout != "contiguous":
        raise ValueError("Ulysses context parallel and linear / sliding-window mixers need the contiguous layout")
    return layout


def chunk_ids(cp: int, rank: int, layout: str) -> tuple[int, ...]:
    """Indices of the sequence chunks rank ``rank`` holds (2*cp chunks load-balanced, else cp)."""
    return (rank, 2 * cp - 1 - rank) if layout == "load_balanced" else (rank,)


def n_chunks(cp: int, layout: str) -> int:
    return 2 * cp if layout == "load_balanced" else cp


def local_positions(seq_len: int, cp: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """(T/cp,) int64 sequence positions of this rank's tokens. Raises ValueError if T does not split."""
    nc = n_chunks(cp, layout)
    if seq_len % nc:
        raise ValueError(f"seq_len ({seq_len}) is not divisible by the {nc} chunks of the {layout} "
                         f"layout with cp={cp}")
    c = seq_len // nc
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank, layout)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (e.g. (B, T) -> (B, T/cp))."""
    pos = local_positions(x.shape[dim], cp, rank, layout, x.device)
    return x.index_select(dim, pos)


def unshard_sequence(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence`` given every rank's shard in rank order."""
    cp = len(shards)
    t = shards[0].shape[dim] * cp
    full = shards[0].new_empty(shards[0].shape[:dim] + (t,) + shards[0].shape[dim + 1:])
    for r, s in enumerate(shards):
        full.index_copy_(dim, local_positions(t, cp, r, layout, s.device), s)
    return full


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor, group: AxisGroup, layout: str,
                documents: torch.Tensor | None = None, balance=None):
    """(B, T) inputs / shifted labels / documents -> this rank's (B, T/cp) inputs, labels, RoPE
    positions ((T/cp,), or (B, T/cp) restarting per document) and documents (None without).
    ``balance``: a ``doc_balance.WorkBalance`` whose work-balanced assignment of this batch's
    documents replaces the layout's (the attention cores read the same assignment)."""
    if balance is not None and documents is not None:
        pos = balance.assign(documents)[group.rank]
    else:
        pos = local_positions(inputs.shape[1], group.size, group.rank, layout, inputs.device)
    cut = (inputs.index_select(1, pos), labels.index_select(1, pos))
    if documents is None:
        return cut + (pos, None)
    return cut + (document_positions(documents).index_select(1, pos), documents.index_select(1, pos))


class LayoutPositions:
    """(cp, T) -> (cp, T/cp) int64 positions of every cp rank's tokens in ``layout`` (cached)."""

    def __init__(self, layout: str):
        self.layout, self._cache = layout, {}

    def __call__(self, cp: int, t: int) -> torch.Tensor:
        if (cp, t) not in self._cache:
            self._cache[(cp, t)] = torch.stack([local_positions(t, cp, i, self.layout) for i in range(cp)])
        return self._cache[(cp, t)]


def _install_core(att: nn.Module, core: nn.Module) -> None:
    """Make ``core`` the attention's per-instance ``core`` hook and show it in ``print(model)``.
    ``nn.Module.__setattr__`` would file it under ``_modules``, where the class method shadows it, so it
    goes into ``__dict__`` and is registered as the parameter-free child ``context_parallel`` (state-dict
    keys unchanged)."""
    att.__dict__["core"] = core
    att.add_module("context_parallel", core)


class RingAttention(nn.Module):
    """``Attention.core`` replacement: ring attention over ``group``. q (B, H, T/cp, D), k / v
    (B, G, T/cp, D) in ``layout`` -> (B, H, T/cp, D). ``documents``: optional (B, T/cp) ids of this
    rank's tokens (packed sequences); every rank's are all-gathered (B T/cp int64 per rank and
    layer). No parameters."""

    def __init__(self, group: AxisGroup, layout: str, causal: bool = True, balance=None):
        super().__init__()
        self.group, self.layout, self.causal = group, layout, causal
        self.every = balance if balance is not None else LayoutPositions(layout)

    def positions(self, local_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.every(self.group.size, local_len * self.group.size).to(device)  # (cp, Tl)
        return kv[self.group.rank], kv

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        q_pos, kv_pos = self.positions(q.shape[2], q.device)
        q_doc = kv_doc = None
        if documents is not None:
            q_doc = documents.to(torch.int64)  # (B, Tl)
            kv_doc = comm.gather_dim(q_doc[None], 0, self.group)  # (cp, B, Tl), rank order as kv_pos
        return ring_attention(q, k, v, self.group, q_pos, kv_pos, self.causal, q_doc, kv_doc)

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, layout={self.layout}, causal={self.causal}, K/V: ring send/recv"


class UlyssesAttention(nn.Module):
    """Runs ``inner`` (the model's own core) under Ulysses all-to-alls: q (B, H, T/cp, D), k / v
    (B, G, T/cp, D) -> (B, H, T/cp, D); ``inner`` sees (B, H/cp, T, D). No parameters."""

    def __init__(self, group: AxisGroup, inner):
        super().__init__()
        self.group, self.inner = group, inner

    def forward(self, q, k, v, documents=None):
        if documents is None:
            return ulysses_attention(q, k, v, self.group, self.inner)
        full = comm.gather_dim(documents.to(torch.int64), 1, self.group)  # (B, T): contiguous layout
        return ulysses_attention(q, k, v, self.group, lambda q_, k_, v_: self.inner(q_, k_, v_, documents=full))

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, all-to-all sequence <-> heads"


def apply_cp(model: nn.Module, mesh: Mesh, impl: str = "ring", layout: str = "auto",
             causal: bool = True, cp_ulysses: int = 1, balance=None) -> str:
    """Install each block's cp form (ring / Ulysses core, window core, ``StatePasser``), shown as the
    mixer's ``context_parallel`` child; with MTP a ``ContextParallelShift`` ``mtp_shift`` hook.

    ``causal`` applies to ring / hybrid attention; ``cp_ulysses``: the all-to-all degree of
    ``impl="hybrid"`` (``hybrid.HybridAttention``); ``balance``: a ``doc_balance.WorkBalance`` the ring /
    hybrid cores take their positions from (packed documents). Returns the resolved layout, which ``shard_batch`` must use.
    Raises ValueError for an unknown impl / layout, a layout the mixers cannot use, a DSA layer, or
    (at forward time) heads not divisible by cp under Ulysses."""
    from ndtrain.model.dsa import SparseAttention
    from ndtrain.model.sliding_window import SlidingWindowAttention

    group = mesh.group("cp")
    cfg = getattr(model, "cfg", None)
    layout = resolve_layout(impl, layout, non_softmax_mixers(cfg) if cfg is not None else ())
    if group.size == 1:
        return layout
    if impl not in ("ring", "ulysses", "hybrid"):
        raise ValueError(f"parallel.cp_impl ({impl}) must be ring|ulysses|hybrid")
    softmax_core = _softmax_core_factory(mesh, impl, layout, causal, cp_ulysses, balance)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # MTP depths: shifted ids from the other cp ranks (mtp_shift), blocks as below
        from ndtrain.parallel.cp.mtp_shift import ContextParallelShift

        model.mtp_shift = ContextParallelShift(group, layout, local_positions)
    blocks = list(model.layers.values()) + ([m.block for m in mtp.values()] if mtp is not None else [])
    for block in blocks:
        att = block.attention
        if hasattr(type(att), "state_passer"):  # linear family: the hook, not an attention core
            if layout != "contiguous":
                raise ValueError("linear mixers under context parallel need the contiguous layout")
            att.__dict__["state_passer"] = passer = StatePasser(group)  # shadows the class's None
            att.add_module("context_parallel", passer)
        elif isinstance(att, SparseAttention):
            raise ValueError("dsa layers under cp > 1 are not built (the indexer scores every earlier key)")
        elif isinstance(att, SlidingWindowAttention):
            if layout != "contiguous":
                raise ValueError("sliding-window attention under context parallel needs the contiguous layout")
            _install_core(att, WindowContextParallel(group, att.window))
        else:
            _install_core(att, softmax_core(att))
    return layout


def _softmax_core_factory(mesh: Mesh, impl: str, layout: str, causal: bool, cp_ulysses: int, balance):
    """attention module -> its cp core; hybrid's sub-groups are built once, here (collective)."""
    group = mesh.group("cp")
    if impl == "ring":
        return lambda att: RingAttention(group, layout, causal, balance)
    if impl == "ulysses":
        return lambda att: UlyssesAttention(group, att.core)
    from ndtrain.parallel.cp.hybrid import HybridAttention, build_subgroups

    inner, outer = build_subgroups(mesh, cp_ulysses)
    every = balance if balance is not None else LayoutPositions(layout)
    return lambda att: HybridAttention(group, inner, outer, every, causal)
