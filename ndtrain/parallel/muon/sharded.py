"""Muon on a sharded layout: every matrix is orthogonalised whole, so the step is the
single-process step (``ndtrain.optim.muon``; docs/optimizers.md).

What a rank holds of a Muon matrix W (tp-global (m, n); experts (E, F, C)):

* **ZeRO-1/2/3, HSDP** (``dp.entries``): padded dim-0 row blocks over the shard group
  (``dp_shard_cp``; ``flat_shard``). Each matrix gets one *owner* in the shard group (greedy
  longest-processing-time on its Newton-Schulz FLOPs, so the NS work is balanced). One all-to-all
  sends every rank's block of the Nesterov update to the owner, the owner reassembles the matrix,
  orthogonalises it and a second all-to-all sends every rank its rows of the result. HSDP
  replicas (``dp_replicate``) do the same on equal data.
* **TP**: a column- or row-split matrix is gathered over ``tp`` (``tp_full_tensor``) before the
  iteration and cut back after (``tp_local_slice``): orthogonalising each slice alone would be a
  different optimizer. Under ZeRO the owner gathers over tp: owners of one matrix on the tp ranks
  of a tp group share their data-parallel coordinates, so they form that tp group.
* **EP**: a rank's experts (E/ep, F, C) are whole matrices along dim 0, and so are ZeRO's row
  blocks of them while dim 0 is the shard dim: each is orthogonalised where it lies, no traffic
  (padding experts are zero and stay zero). With fewer local experts than shard ranks ZeRO
  shards dim 1 (``flat_shard.shard_dim``): those are routed like any matrix, the owner
  orthogonalising every expert of the batch.
* **PP**: each stage's optimizer holds its stage's matrices; tied embeddings are AdamW anyway.
* plain data parallel (DDP): every rank holds the whole matrix and the same gradient; each
  orthogonalises every matrix (redundant compute, no traffic).

Traffic per step and rank of the ZeRO routing over N shard ranks, b bytes per master element,
s_j = padded block elements of matrix j on one rank (``FlatShardLayout.sizes``: Psi_j,pad / N),
``mine`` the matrices this rank owns: ``b (sum_{j not mine} s_j + (N-1) sum_{j mine} s_j)``
(``route_bytes``: the blocks it sends to owners, then its own results' blocks to the N-1 others),
~ 2 (N-1)/N^2 Psi_muon,pad b when balanced (2/N of a ZeRO parameter all-gather's (N-1)/N Psi b);
exactly Psi_muon,pad b / 2 for N = 2. TP adds one all-gather of each split matrix over tp
((tp-1) x its local bytes) on the ranks that orthogonalise it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ndtrain.model.attention import Attention
from ndtrain.ops.newton_schulz import newton_schulz, ns_flops
from ndtrain.optim.muon import build_muon, ns_dtype
from ndtrain.optim.mup import hidden_lr_factor, split_hidden_adamw
from ndtrain.parallel.ep.collectives import all_to_all_v
from ndtrain.parallel.muon.qk_clip import QKClip, Target
from ndtrain.parallel.tp.tensor_parallel import tp_full_tensor, tp_local_slice, tp_specs


@dataclass
class Matrix:
    """One Muon parameter as this rank holds it.

    Attributes: ``name`` (single-process name), ``shape`` (the tensor the shard group's blocks
    assemble to: tp-local, ep-local), ``mn`` (the whole matrix's (m, n)), ``tp`` (``tp_specs``
    entry or None), ``route`` ((``FlatShardLayout``, index, shard ``AxisGroup``) or None: held
    whole along data parallel), ``batched`` (a leading expert dim: rows are whole matrices).
    """

    name: str
    shape: torch.Size
    mn: tuple[int, int]
    tp: tuple | None = None
    route: tuple | None = None
    batched: bool = False

    @property
    def routed(self) -> bool:
        if self.route is None or self.route[2].size == 1:
            return False
        return not self.batched or self.route[0].dims[self.route[1]] != 0  # dim-0 blocks are whole experts

    def flops(self, steps: int) -> int:
        batch = self.shape[0] if self.batched else 1
        return ns_flops(*self.mn, steps, batch)


def assign_owners(flops: list[int], n: int) -> list[int]:
    """Owner rank of each matrix: largest first onto the least-loaded rank (ties: lower index,
    lower rank). Deterministic, so every rank computes the same plan."""
    load, owner = [0] * n, [0] * len(flops)
    for j in sorted(range(len(flops)), key=lambda j: (-flops[j], j)):
        k = min(range(n), key=lambda r: (load[r], r))
        owner[j], load[k] = k, load[k] + flops[j]
    return owner


def route_bytes(sizes: list[int], owner: list[int], rank: int, n: int, elem: int) -> int:
    """Bytes ``rank`` sends for one routed step (module docstring); ``sizes``: s_j."""
    mine = sum(s for s, o in zip(sizes, owner) if o == rank)
    return elem * (sum(sizes) - mine + (n - 1) * mine)


class ShardedOrthogonalizer:
    """``Muon``'s ``orthogonalize`` for a layout: ``(params, updates, steps) -> updates``.

    Args: ``matrices`` (``{id(param): Matrix}``), ``tp`` (the tp ``AxisGroup``).
    ``owners``: after a call, ``{shard group name: (names, owner ranks, block sizes)}``.
    """

    def __init__(self, matrices: dict[int, Matrix], tp):
        self.matrices, self.tp = matrices, tp
        self.owners: dict[str, tuple] = {}

    def flops_per_step(self, steps: int) -> int:
        """NS FLOPs this rank runs per step: its own routed matrices (the plan every call makes
        when every matrix has a gradient, as sharded layouts guarantee) and every unrouted one."""
        mats = list(self.matrices.values())
        total = sum(m.flops(steps) for m in mats if not m.routed)
        groups: dict[str, list[Matrix]] = {}
        for m in mats:
            if m.routed:
                groups.setdefault(m.route[2].name, []).append(m)
        for ms in groups.values():
            group = ms[0].route[2]
            owner = assign_owners([m.flops(steps) for m in ms], group.size)
            total += sum(m.flops(steps) for m, o in zip(ms, owner) if o == group.rank)
        return total

    def _whole(self, m: Matrix, x: torch.Tensor, steps: int) -> torch.Tensor:
        """NS of this rank's tp-local matrix ``x``, gathered over tp first when split."""
        full = tp_full_tensor(x, m.tp, self.tp) if m.tp is not None else x
        o = newton_schulz(full, steps, ns_dtype(full))
        return tp_local_slice(o, m.tp, self.tp) if m.tp is not None else o

    def __call__(self, params: list[torch.Tensor], updates: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(params)
        mats = [self.matrices[id(p)] for p in params]
        by_group: dict[str, list[int]] = {}
        for i, m in enumerate(mats):
            if m.routed:
                by_group.setdefault(m.route[2].name, []).append(i)
        pending = [self._gather_to_owners([mats[i] for i in idx], [updates[i] for i in idx], steps)
                   for idx in by_group.values()]
        done = [self._orthogonalize_owned(p, steps) for p in pending]
        for i, m in enumerate(mats):  # whole along data parallel: here
            if not m.routed:
                out[i] = self._whole(m, updates[i], steps)
        for idx, res in zip(by_group.values(), (self._scatter_back(p, d) for p, d in zip(pending, done))):
            for i, o in zip(idx, res):
                out[i] = o
        return out

    def _gather_to_owners(self, mats: list[Matrix], updates: list[torch.Tensor], steps: int) -> dict:
        group = mats[0].route[2]
        n, me = group.size, group.rank
        sizes = [m.route[0].sizes[m.route[1]] for m in mats]
        owner = assign_owners([m.flops(steps) for m in mats], n)
        self.owners[group.name] = ([m.name for m in mats], owner, sizes)
        order = sorted(range(len(mats)), key=lambda j: (owner[j], j))
        send = torch.cat([updates[j].reshape(-1) for j in order])
        in_splits = [sum(s for s, o in zip(sizes, owner) if o == k) for k in range(n)]
        mine = [j for j in range(len(mats)) if owner[j] == me]
        s_mine = sum(sizes[j] for j in mine)
        recv = send.new_empty(n * s_mine)
        all_to_all_v(recv, send, [s_mine] * n, in_splits, group)
        grid = recv.view(n, s_mine)
        fulls, col = {}, 0
        for j in mine:  # (N, s_j) blocks -> the whole matrix, padding dropped
            layout, i = mats[j].route[:2]
            fulls[j] = layout.assemble(grid[:, col:col + sizes[j]], i).reshape(mats[j].shape)
            col += sizes[j]
        return {"mats": mats, "owner": owner, "sizes": sizes, "mine": mine, "fulls": fulls,
                "like": updates[0]}

    def _orthogonalize_owned(self, pend: dict, steps: int) -> dict[int, torch.Tensor]:
        return {j: self._whole(pend["mats"][j], pend["fulls"][j], steps) for j in pend["mine"]}

    def _scatter_back(self, pend: dict, done: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        mats, owner, sizes, mine = pend["mats"], pend["owner"], pend["sizes"], pend["mine"]
        group = mats[0].route[2]
        n = group.size
        blocks = []
        for j in mine:  # padded (N, s_j): row block k goes to rank k
            layout, i = mats[j].route[:2]
            blocks.append(layout.split(done[j].reshape(layout.shapes[i]), i))
        like = pend["like"]
        send = torch.cat(blocks, dim=1).reshape(-1) if blocks else like.new_empty(0)
        s_mine = sum(sizes[j] for j in mine)
        out_splits = [sum(s for s, o in zip(sizes, owner) if o == k) for k in range(n)]
        recv = like.new_empty(sum(out_splits))
        all_to_all_v(recv, send, out_splits, [s_mine] * n, group)
        res: list[torch.Tensor | None] = [None] * len(mats)
        off = 0
        for j in sorted(range(len(mats)), key=lambda j: (owner[j], j)):
            layout, i = mats[j].route[:2]
            res[j] = layout.block_view(recv[off:off + sizes[j]], i)
            off += sizes[j]
        return res


def _tp_global(shape, spec) -> tuple[int, ...]:
    shape = list(shape)
    if spec is not None and len(shape):
        shape[spec[0]] = spec[1]
    return tuple(shape)


def build_qk_clip(module, held: list[tuple], group, tau: float) -> QKClip:
    """``QKClip`` over every ``Attention`` (exactly; rules refuse the other softmax kinds) of
    ``module``; ``held``: ``(name, held tensor, rank-local shape, ZeRO route or None)`` per parameter."""
    by_name = {n: (p, shape, route) for n, p, shape, route in held}
    targets = []
    for name, mod in module.named_modules():
        if type(mod) is not Attention:
            continue
        ends = []
        for w in ("wq", "wk"):
            p, shape, route = by_name[f"{name}.{w}.weight" if name else f"{w}.weight"]
            row0 = route[2].rank * route[0].rows[route[1]] if route is not None else 0
            ends.append((p, row0, shape[0]))
        (wq, q0, qr), (wk, k0, kr) = ends
        targets.append(Target(mod, wq, wk, q0, k0, qr, kr, mod.head_dim))
    return QKClip(tau, targets, group)


def build_train_optimizer(dp, mesh, tcfg) -> torch.optim.Optimizer:
    """The trainer's optimizer: ``dp.build_optimizer`` (AdamW) or, for ``training.optimizer:
    muon``, ``ndtrain.optim.muon.Muon`` over what ``dp`` steps (its master shards under ZeRO / FSDP,
    the module's parameters otherwise) with a ``ShardedOrthogonalizer`` for the layout."""
    specs = tp_specs(dp.module)
    if hasattr(dp, "entries"):  # ZeRO-1/2/3, HSDP
        held = [(e.fqn, e.param, e.shape, (e.layout, e.index, e.domain.shard_group)) for e in dp.entries]
    else:
        held = [(n, p, p.shape, None) for n, p in dp.module.named_parameters()]
    shapes = {n: _tp_global(shape, specs.get(n)) for n, _, shape, _ in held}
    width = dp.module.cfg.dim  # muP's width (training.mup_base_width)
    if tcfg.optimizer != "muon":
        opt = dp.build_optimizer(tcfg)
        if tcfg.mup_base_width:
            split_hidden_adamw(opt, [(n, p, shapes[n]) for n, p, _, _ in held], tcfg, width)
        return opt
    opt = build_muon([(n, p) for n, p, _, _ in held], tcfg, shapes,
                     lr_factor=hidden_lr_factor("muon", tcfg.muon_scale, width, tcfg.mup_base_width))
    muon_ids = {id(p) for g in opt.param_groups if g["kind"] == "muon" for p in g["params"]}
    matrices = {id(p): Matrix(n, torch.Size(shape), tuple(shapes[n][-2:]), specs.get(n), route, len(shape) == 3)
                for n, p, shape, route in held if id(p) in muon_ids}
    opt.orthogonalize = ShardedOrthogonalizer(matrices, mesh.group("tp"))
    if tcfg.qk_clip > 0:
        opt.qk_clip = build_qk_clip(dp.module, held, mesh.group("dp_shard_cp" if tcfg.local_sgd_steps else "dp_cp"),
                                    tcfg.qk_clip)
    if hasattr(dp, "adopt_optimizer"):
        dp.adopt_optimizer(opt)
    return opt
