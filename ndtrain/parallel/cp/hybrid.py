"""Hierarchical (hybrid) context parallel: Ulysses all-to-all inside groups of ``cp_ulysses`` cp ranks,
ring attention across those groups (Megatron-Core's ``a2a+p2p`` cp_comm_type; docs/context_parallel.md,
"Hybrid").

cp rank ``c = o * u + i`` (u = cp_ulysses, R = cp / u): inner group ``cp_a2a`` = the u ranks of one
``o`` (consecutive cp ranks: the same node when cp ranks are packed per node), outer group
``cp_ring`` = the R ranks of one ``i``. Per layer:

    q (B, H, T/cp, D), k / v (B, G', T/cp, D)   --a2a over cp_a2a-->   (B, H/u, u T/cp, D)
    ring attention over cp_ring on the u T/cp tokens of the inner group (positions say which)
    out (B, H/u, u T/cp, D)                     --a2a over cp_a2a-->   (B, H, T/cp, D)

Only u must divide the heads, so cp may exceed the kv heads: G kv heads are replicated to the fewest
G' = G * u / gcd(G, u) that splits over u (Megatron replicates kv heads the same way); the gradients
of the copies sum back. Bytes per layer and rank (elements x element size, S = B (T/cp) D):
cp_a2a 2 (u-1)/u (2 H + 2 G') S (forward + backward); cp_ring 2 (3R - 2) G' S when R > 1 (ring's
(R-1) K/V blocks forward, (R-1) K/V + R dK/dV backward, each (B, G'/u, u T/cp, 2D))."""
from __future__ import annotations

import math

import torch
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.parallel import comm
from ndtrain.parallel.cp.collectives import AllToAll
from ndtrain.parallel.cp.ring import ring_attention

HEAD_DIM, SEQ_DIM = 1, 2  # q / k / v are (B, H, T, D)


def kv_replicas(n_kv: int, u: int) -> int:
    """Copies of each kv head so that the kv heads split over ``u`` ranks: u / gcd(G, u) (1 when u | G)."""
    return u // math.gcd(n_kv, u)


def split_groups(cp_ranks: list[int], u: int) -> tuple[list[list[int]], list[list[int]]]:
    """One cp group's global ranks (cp rank order) -> (inner groups of u consecutive ranks, outer groups
    of the ranks with the same inner index). Raises ValueError when u does not divide the group."""
    n = len(cp_ranks)
    if u < 1 or n % u:
        raise ValueError(f"parallel.cp_ulysses ({u}) must divide cp ({n})")
    inner = [cp_ranks[o * u:(o + 1) * u] for o in range(n // u)]
    outer = [cp_ranks[i::u] for i in range(u)]
    return inner, outer


def build_subgroups(mesh: Mesh, u: int) -> tuple[AxisGroup, AxisGroup]:
    """This rank's (``cp_a2a``, ``cp_ring``) groups, counting bytes in the mesh's stats under those names.
    Collective: every rank creates every cp group's sub-groups in the same order (``new_group``)."""
    import torch.distributed as dist

    cp = mesh.group("cp")
    r_ring = cp.size // u
    if getattr(mesh, "device_mesh", None) is None or cp.size == 1:
        return (AxisGroup("cp_a2a", u, 0, None, mesh.stats), AxisGroup("cp_ring", r_ring, 0, None, mesh.stats))
    ranks = mesh.device_mesh.mesh.movedim(3, -1).reshape(-1, cp.size).tolist()  # every cp group (AXES: cp 4th)
    me = dist.get_rank()
    mine = {}
    for row in ranks:
        inner, outer = split_groups(row, u)
        for name, groups in (("cp_a2a", inner), ("cp_ring", outer)):
            for g in groups:
                pg = dist.new_group(g) if len(g) > 1 else None
                if me in g:
                    mine[name] = AxisGroup(name, len(g), g.index(me), pg, mesh.stats)
    return mine["cp_a2a"], mine["cp_ring"]


class HybridAttention(nn.Module):
    """``Attention.core`` replacement: q (B, H, T/cp, D), k / v (B, G, T/cp, D), this cp rank's tokens at
    ``positions(cp, T)[rank]`` -> (B, H, T/cp, D). ``positions``: callable (cp, T) -> (cp, T/cp) int64
    positions of every cp rank's tokens (the layout, or the documents' work-balanced assignment).
    ``documents`` (B, T/cp): gathered over cp (B T/cp int64 per rank and layer). No parameters. Raises
    ValueError when H is not divisible by cp_ulysses."""

    def __init__(self, cp: AxisGroup, inner: AxisGroup, outer: AxisGroup, positions, causal: bool = True):
        super().__init__()
        self.cp, self.inner, self.outer, self.positions, self.causal = cp, inner, outer, positions, causal

    def _group_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(cp, ...) per cp rank, last dim tokens -> (R, ..., u * tokens): each inner group's tokens joined
        in inner-rank order (the order the all-to-all gathers them)."""
        u = self.inner.size
        return torch.stack([torch.cat(list(x[o * u:(o + 1) * u]), dim=-1) for o in range(self.outer.size)])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        u, h, g = self.inner.size, q.shape[HEAD_DIM], k.shape[HEAD_DIM]
        if h % u:
            raise ValueError(f"hybrid cp: heads per tp rank ({h}) are not divisible by cp_ulysses ({u})")
        rep = kv_replicas(g, u)
        if rep > 1:  # whole kv heads per rank; the copies' gradients sum back through repeat_interleave
            k, v = k.repeat_interleave(rep, dim=HEAD_DIM), v.repeat_interleave(rep, dim=HEAD_DIM)
        kv_pos = self._group_rows(self.positions(self.cp.size, q.shape[2] * self.cp.size).to(q.device))
        q_pos = kv_pos[self.outer.rank]  # (u T/cp,)
        q_doc = kv_doc = None
        if documents is not None:
            every = comm.gather_dim(documents.to(torch.int64)[None], 0, self.cp)  # (cp, B, T/cp)
            kv_doc = self._group_rows(every)  # (R, B, u T/cp)
            q_doc = kv_doc[self.outer.rank]
        q, k, v = (AllToAll.apply(x.contiguous(), self.inner, HEAD_DIM, SEQ_DIM) for x in (q, k, v))
        out = ring_attention(q, k, v, self.outer, q_pos, kv_pos, self.causal, q_doc, kv_doc)  # (B, H/u, uT/cp, D)
        return AllToAll.apply(out.contiguous(), self.inner, SEQ_DIM, HEAD_DIM)  # (B, H, T/cp, D)

    def extra_repr(self) -> str:
        return (f"cp={self.cp.size} = {self.inner.size} (all-to-all) x {self.outer.size} (ring), "
                f"causal={self.causal}")


def hybrid_bytes(b: int, t_local: int, h: int, g: int, d: int, u: int, r: int, elem_bytes: int) -> dict[str, float]:
    """Bytes one rank sends per layer and microbatch (forward + backward) by axis, for q / k / v / out of
    head dim ``d`` and ``t_local`` = T / cp tokens: see the module docstring."""
    gp = g * kv_replicas(g, u)
    s = b * t_local * d * elem_bytes
    out = {}
    if u > 1:
        out["cp_a2a"] = 2 * (u - 1) / u * (2 * h + 2 * gp) * s
    if r > 1:
        out["cp_ring"] = 2 * (3 * r - 2) * gp * s
    return out
