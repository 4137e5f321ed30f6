"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): fp32 masters and Adam moments sharded over
``dp_shard_cp``, full compute-dtype parameters in the model (docs/sharded_data_parallel.md).

Buckets (``dp.buckets``, shared with DDP) reduce-scatter in ``reduce_dtype`` (``reduce``): ZeRO-1
once per step, ZeRO-2 every microbatch, so no full gradient is kept; a step post-hook all-gathers
the updated shards. Expert parameters use ``edp_shard`` and never share a bucket with dense ones.
Traffic per rank and step: ZeRO-1 (N-1)/N Psi_pad (b_r + b_c), ZeRO-2 (N-1)/N Psi_pad (M b_r +
b_c), HSDP + 2 (R-1)/R Psi_pad / N b_r; bytes per parameter (bf16, K = 12): 2 + 2 + 12/N and
2 + (4 + 12)/N."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel import comm
from ndtrain.parallel.dp.buckets import BucketLauncher, group_into_buckets, unique_named_params
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.parallel.zero.sharded_state import ShardedDataParallelBase, ShardEntry


class _Bucket:
    """Parameters of one shard domain reduced together; master shards in one flat buffer (S,)."""

    def __init__(self, params: list[nn.Parameter], layout: FlatShardLayout, master: torch.Tensor, domain):
        self.params, self.layout, self.master, self.domain = params, layout, master, domain
        self.entries: list[ShardEntry] = []
        self.acc: torch.Tensor | None = None  # (S,) accumulated reduced gradient, master dtype
        self.pending: list[tuple] = []  # (work, out (S,), in (N*S,))


class ZeroDataParallel(ShardedDataParallelBase):
    """ZeRO-1 / ZeRO-2 over ``dp_shard_cp`` (+ ``dp_replicate`` for HSDP); experts over ``edp_shard``.

    Args:
        module: the model, full master-dtype (fp32 / fp64) parameters, equal on all ranks.
        mesh: the ``Mesh``. stage: 1 or 2. bucket_size_bytes: in reduce-dtype bytes.
        compute_dtype / reduce_dtype: parameter and reduction dtypes (None = master).
        expert_names: ``apply_ep``'s expert parameters (empty without ep).
    Raises ValueError for another stage or mixed parameter dtypes."""

    def __init__(self, module: nn.Module, mesh, stage: int, bucket_size_bytes: int = 25 * 2**20,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 expert_names=()):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, not {stage}")
        self.module, self.stage = module, stage
        self._init_domains(mesh, expert_names)
        named = unique_named_params(module)
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.master_dtype = dtypes.pop()
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.master_dtype
        self.buckets: list[_Bucket] = []
        by_name = {}
        for grp in self._split_domains(group_into_buckets(named, bucket_size_bytes, self.reduce_dtype)):
            b = self._shard_bucket(grp)
            self.buckets.append(b)
            by_name.update({e.fqn: e for e in b.entries})
        with torch.no_grad():
            for _, p in named:
                if p.dtype != self.compute_dtype:
                    p.data = p.data.to(self.compute_dtype)
        self.entries = [by_name[name] for name, _ in named]
        first = {id(p): name for name, p in named}
        for name, p in module.named_parameters(remove_duplicate=False):  # tied weights' other names
            if id(p) in first and first[id(p)] != name:
                by_name[first[id(p)]].aliases += (name,)
        self._launcher = BucketLauncher([b.params for b in self.buckets], self._launch)
        self._init_reducer()
        if stage == 2:
            for _, p in named:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _split_domains(self, groups: list[list[tuple[str, nn.Parameter]]]) -> list[list[tuple[str, nn.Parameter]]]:
        """Cut each bucket where it mixes dense and expert parameters: a bucket reduces over one group."""
        out = []
        for grp in groups:
            parts: dict[str, list] = {}
            for name, p in grp:
                parts.setdefault(self.domain_of(name).name, []).append((name, p))
            out += list(parts.values())
        return out

    @torch.no_grad()
    def _shard_bucket(self, grp: list[tuple[str, nn.Parameter]]) -> _Bucket:
        """This rank's master shards of a bucket's parameters, one ``ShardEntry`` each."""
        params = [p for _, p in grp]
        domain = self.domain_of(grp[0][0])
        n, rank = domain.shard_group.size, domain.shard_group.rank
        layout = FlatShardLayout([p.shape for p in params], n, rank)
        master = layout.shard_from_full([p.detach() for p in params], torch.empty(
            layout.shard_numel, dtype=self.master_dtype, device=params[0].device))
        b = _Bucket(params, layout, master, domain)
        for i, (name, p) in enumerate(grp):
            sp = nn.Parameter(layout.shard_view(master, i))
            setattr(sp, SHARD_AXES_ATTR, shard_axes(p))
            b.entries.append(ShardEntry(name, p.shape, layout, i, sp, shard_axes(p), domain=domain))
        return b

    @contextlib.contextmanager
    def no_sync(self):
        """No-op for both stages: ZeRO-1 reduces once in ``finish_grad_sync`` anyway, ZeRO-2 every
        microbatch."""
        yield

    # --- gradient reduction (``reduce.py``) ------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._queue_end_of_backward()  # launches leftovers (unused parameters)
        if self.observers:
            self.observers.state(self)
        self._launcher.mark_ready(p)

    def _launch(self, i: int) -> None:
        b = self.buckets[i]
        full, out = self._pack_grads(b, b.params, b.master.device)
        self._start_reduce(b, full, out)

    def _end_of_backward(self) -> None:
        self._launcher.launch_rest()
        self._drain()
        self._callback_queued = False

    def finish_grad_sync(self) -> None:
        """Reduce what is left, all-reduce over ``dp_replicate``, set the shards as ``entry.param.grad``."""
        if self.stage == 1 or self._launcher.started:
            self._launcher.launch_rest()
        self._drain()
        self._publish_grad_shards(self.buckets, self.buckets[0].master.device)

    # --- parameters --------------------------------------------------------------------------
    @torch.no_grad()
    def _after_step(self) -> None:
        """All-gather the updated master shards (cast to the compute dtype) into the model."""
        launched = []
        for b in self.buckets:
            src = b.master if self.compute_dtype == self.master_dtype else b.master.to(self.compute_dtype)
            buf = torch.empty(b.layout.padded_numel, dtype=self.compute_dtype, device=b.master.device)
            group = b.domain.shard_group
            work = comm.all_gather_into(buf, src, group, async_op=True) if buf.numel() else None
            launched.append((b, buf, work))
        for b, buf, work in launched:
            if work is not None:
                work.wait()
            b.layout.unpack(buf, [p.data for p in b.params])

    _after_load = _after_step

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Per ``mem_account`` category: params (compute dtype), grads (unreduced full ones, shards),
        optimizer state (masters + moments)."""
        params = [p for b in self.buckets for p in b.params]
        grads = [p.grad for p in params if p.grad is not None]
        grads += [b.acc for b in self.buckets if b.acc is not None]
        grads += [e.param.grad for e in self.entries if e.param.grad is not None]
        optim = [b.master for b in self.buckets]
        if self.optimizer is not None:
            optim += [t for st in self.optimizer.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor)]
        buffers = [t for b in self.buckets for (_, o, f) in b.pending for t in (o, f)]
        return {"params": params, "grads": grads, "optim": optim, "buffers": buffers}
