"""ZeRO-3 / fully sharded data parallel (Rajbhandari et al. 2020; Zhao et al. 2023, "PyTorch FSDP")
and HSDP; hooks, traffic and memory: docs/sharded_data_parallel.md, "ZeRO-3 / FSDP".

Units (``units.default_units``) are sharded along dim 0 with padding (``flat_shard``); the module
keeps unsharded compute-dtype parameters whose storage exists only while gathered
(``untyped_storage().resize_``), so autograd's saved references see the re-gathered values. Units
reduce-scatter strictly in reverse order of their first segments on every rank (an end-of-backward
callback takes units that got no gradient); ZeRO-3 reduces every microbatch, so ``no_sync`` is a
no-op; checkpoint recompute gathers without prefetching and never frees. Outside a unit's forward /
backward the parameters are placeholders: read ``model_state_dict()``."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ndtrain.mem_account import untracked
from ndtrain.parallel import comm
from ndtrain.parallel.zero.sharded_state import ShardedDataParallelBase
from ndtrain.parallel.zero.units import Unit, default_units, expert_units, shard_unit


def _in_backward() -> bool:
    """True while autograd runs a node, i.e. a forward inside backward (checkpoint recompute)."""
    return torch._C._current_autograd_node() is not None


class FullyShardedDataParallel(ShardedDataParallelBase):
    """ZeRO-3 over ``dp_shard_cp``; HSDP when ``dp_replicate`` > 1; expert units over ``edp_shard``.

    Args:
        module: the model, full master-dtype parameters, equal on all ranks.
        mesh: the ``Mesh``.
        units: ``(name, segments)`` (default ``default_units``), run in registration order.
        reshard_after_forward: free a unit after its forward (after its last segment).
        keep_last_unit: keep the forward-last unit gathered into its backward.
        compute_dtype / reduce_dtype: gather + compute, reduce-scatter dtypes (None = master).
        expert_names: ``apply_ep``'s expert parameters (empty without ep).
    Raises ValueError if a parameter belongs to no unit or to two (tied weights share a unit)."""

    def __init__(self, module: nn.Module, mesh, units=None, reshard_after_forward: bool = True,
                 keep_last_unit: bool = True, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, expert_names=()):
        self.module = module
        self._init_domains(mesh, expert_names)
        self.reshard_after_forward, self.keep_last_unit = reshard_after_forward, keep_last_unit
        order = [name for name, p in module.named_parameters() if p.requires_grad]
        dtypes = {p.dtype for p in module.parameters()}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.master_dtype = dtypes.pop()
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.master_dtype
        mod_names = {id(m): n for n, m in module.named_modules()}
        mod_pos = {id(m): i for i, (_, m) in enumerate(module.named_modules())}
        self.units = [Unit(i, name, segs, self.dense) for i, (name, segs) in enumerate(units or default_units(module))]
        self.units += [Unit(len(self.units) + i, name, segs, self.expert)
                       for i, (name, segs) in enumerate(expert_units(module, expert_names))]
        # forward order of segments, and the order units finish backward (latest first segment first)
        self._segs = sorted(((mod_pos[id(seg[0])], u, si) for u in self.units for si, seg in enumerate(u.segments)),
                            key=lambda x: x[0])
        self._segs = [(u, si) for _, u, si in self._segs]
        self._final_unit = self._segs[-1][0]
        first = {u.index: min(k for k, (v, _) in enumerate(self._segs) if v is u) for u in self.units}
        self._rs_order = sorted(self.units, key=lambda u: -first[u.index])
        owner_of, by_name = {}, {}
        named = dict(module.named_parameters())
        nested = frozenset(id(named[n]) for n in expert_names)  # owned by the expert units
        for u in self.units:
            shard_unit(u, mod_names, owner_of, by_name, self.master_dtype, self.compute_dtype,
                       skip=frozenset() if u.domain is self.expert else nested)
        missing = [n for n in order if n not in by_name]
        if missing:
            raise ValueError(f"parameters in no FSDP unit: {missing}")
        self.entries = [by_name[n] for n in order]
        self._rs_next = 0  # index into self._rs_order of the next reduce-scatter
        self._init_reducer()
        for k, (u, si) in enumerate(self._segs):
            seg = u.segments[si]
            seg[0].register_forward_pre_hook(functools.partial(self._pre_forward, k))
            seg[-1].register_forward_hook(functools.partial(self._post_forward, k))
        for u in self.units:
            for p in u.full:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u))

    @contextlib.contextmanager
    def no_sync(self):
        """No-op: ZeRO-3 reduce-scatters every microbatch so that no full gradient is kept."""
        yield

    @contextlib.contextmanager
    def gathered(self, params):
        """Inside: every unit holding one of ``params`` is gathered; on exit those this call gathered are
        freed. For the zero-bubble W pass, which may read parameters freed since B. Collective over each
        unit's shard group: every rank must pass the same units."""
        ids = {id(p) for p in params}
        units = [u for u in self.units if any(id(p) in ids for p in u.full)]
        mine = [u for u in units if u.state != "gathered"]
        for u in mine:
            self._gather(u)
        try:
            yield
        finally:
            for u in mine:
                self._reshard(u)

    # --- gather / free ----------------------------------------------------------------------
    def _start_gather(self, u: Unit) -> None:
        if u.state != "sharded":
            return
        with untracked():
            src = u.shard if self.compute_dtype == self.master_dtype else u.shard.to(self.compute_dtype)
            buf = torch.empty(u.layout.padded_numel, dtype=self.compute_dtype, device=u.shard.device)
        work = comm.all_gather_into(buf, src, u.domain.shard_group, async_op=True) if buf.numel() else None
        u.gather = (work, buf, src)
        u.state = "gathering"

    @torch.no_grad()
    def _gather(self, u: Unit) -> None:
        if u.state == "gathered":
            return
        if self.observers:
            self.observers.gather(self, u.state == "gathering")
        self._start_gather(u)
        work, buf, _ = u.gather
        if work is not None:
            work.wait()
        for p in u.full:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        u.layout.unpack(buf, [p.data for p in u.full])  # .data: no version-counter bump
        u.gather, u.state = None, "gathered"
        if self.observers:
            self.observers.state(self)

    def _reshard(self, u: Unit) -> None:
        if u.state == "gathering":
            work = u.gather[0]
            if work is not None:
                work.wait()
            u.gather = None
        for p in u.full:
            p.untyped_storage().resize_(0)
        u.state = "sharded"

    # --- hooks ------------------------------------------------------------------------------
    def _pre_forward(self, k: int, module, args) -> None:
        u = self._segs[k][0]
        self._gather(u)
        if k + 1 < len(self._segs) and not _in_backward() and self._segs[k + 1][0] is not u:
            self._start_gather(self._segs[k + 1][0])  # forward prefetch

    def _post_forward(self, k: int, module, args, output):
        if _in_backward():  # activation-checkpoint recompute: keep u gathered for its backward
            return output
        u, si = self._segs[k]
        out = output[0] if isinstance(output, (tuple, list)) else output
        grad = torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad
        if grad:
            out.register_hook(functools.partial(self._pre_backward, k))
        if si < len(u.segments) - 1:
            return output  # the unit runs again later in this forward (tied embeddings)
        keep = grad and (not self.reshard_after_forward or (self.keep_last_unit and u is self._final_unit))
        if not keep:
            self._reshard(u)
        return output

    def _pre_backward(self, k: int, grad) -> None:
        u = self._segs[k][0]
        self._queue_end_of_backward()
        self._gather(u)
        if k > 0 and self._segs[k - 1][0] is not u:
            self._start_gather(self._segs[k - 1][0])  # backward prefetch

    def _on_grad(self, u: Unit, p) -> None:
        self._queue_end_of_backward()
        u.ready += 1
        if self.observers:
            self.observers.state(self)
        order = self._rs_order
        while self._rs_next < len(order) and order[self._rs_next].ready == len(order[self._rs_next].full):
            self._launch(order[self._rs_next])
            self._rs_next += 1

    # --- gradient reduction (``reduce.py``) ------------------------------------------------------
    def _launch(self, u: Unit) -> None:
        full, out = self._pack_grads(u, u.full, u.shard.device)
        self._reshard(u)
        u.ready = 0
        self._start_reduce(u, full, out)

    def _end_of_backward(self) -> None:
        order = self._rs_order
        while self._rs_next < len(order):  # units some of whose parameters got no gradient
            self._launch(order[self._rs_next])
            self._rs_next += 1
        self._drain()
        for u in self.units:
            if u.state != "sharded":
                self._reshard(u)
        self._rs_next = 0
        self._callback_queued = False

    def finish_grad_sync(self) -> None:
        """All-reduce shards over ``dp_replicate`` (HSDP) and set them as ``.grad`` (zeros if no backward
        ran)."""
        self._drain()
        self._publish_grad_shards(self.units, self.units[0].shard.device)

    def _after_load(self) -> None:
        for u in self.units:
            self._reshard(u)

    # --- accounting ---------------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """params: fp32 master shards; grads: gradient shards; optim: Adam state; buffers (about one or two
        units): gathered parameters, a unit's full gradients before reduce-scatter, comm buffers."""
        grads = [u.acc for u in self.units if u.acc is not None]
        grads += [e.param.grad for e in self.entries if e.param.grad is not None]
        optim = []
        if self.optimizer is not None:
            optim = [t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        buffers = [t for u in self.units for p in u.full for t in (p, p.grad)]
        for u in self.units:
            buffers += list(u.gather[1:]) if u.gather else []
            buffers += [t for _, out, full in u.pending for t in (out, full)]
        return {"params": [u.shard for u in self.units], "grads": grads, "optim": optim, "buffers": buffers}
