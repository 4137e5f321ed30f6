"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models"): the fp32 master weights and Adam moments are sharded over ``dp_shard_cp``;
the model keeps full parameters in the compute dtype (bf16 / fp16 under mixed precision).

Per step, over N = |dp_shard_cp| ranks, with Psi parameters padded to Psi_pad (see ``flat_shard``):

* gradients are reduce-scattered in ``reduce_dtype`` bucket by bucket (buckets and their launch
  order: ``ndtrain.parallel.dp.buckets``, shared with DDP; the reduction: ``reduce.py``): ZeRO-1 once per step in
  ``finish_grad_sync`` (the full gradient lives until then, as in DDP; ``no_sync`` accumulation is
  local), ZeRO-2 from post-accumulate-grad hooks as soon as a bucket is complete, *every*
  microbatch, freeing the full gradients right away, so a full-size gradient is never kept; the
  reduced shards accumulate in the master dtype;
* HSDP-style replication (``dp_replicate`` > 1): the accumulated shards are all-reduced over
  ``dp_replicate`` once per step;
* each rank's AdamW steps its shards; a step post-hook all-gathers the updated shards (cast to the
  compute dtype) back into the model's parameters.

Expert parallel (``expert_names``): the experts a rank holds are sharded over ``edp_shard`` instead
(``domains.py``): their buckets reduce-scatter and all-gather there, never mixing with dense
parameters in one bucket, and the HSDP all-reduce stays on ``dp_replicate``; N, Psi below are then
per domain (the expert Psi is this rank's E/ep experts).

Traffic per rank per step (b_r reduce bytes, b_c compute bytes, M microbatches, R replicas):
ZeRO-1: (N-1)/N Psi_pad (b_r + b_c); ZeRO-2: (N-1)/N Psi_pad (M b_r + b_c); HSDP adds
2 (R-1)/R Psi_pad / N b_r on ``dp_replicate``.
Model-state bytes per parameter (bf16 compute, fp32 master + Adam, K = 12; the gradient shards
are held in fp32): ZeRO-1 2 + 2 + 12/N; ZeRO-2 2 + (4 + 12)/N.
"""
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
    """Parameters of one shard domain reduced together; their master shards live in one flat
    buffer (S,)."""

    def __init__(self, params: list[nn.Parameter], layout: FlatShardLayout, master: torch.Tensor, domain):
        self.params, self.layout, self.master, self.domain = params, layout, master, domain
        self.entries: list[ShardEntry] = []
        self.acc: torch.Tensor | None = None  # (S,) accumulated reduced gradient, master dtype
        self.pending: list[tuple] = []  # (work, out (S,), in (N*S,))


class ZeroDataParallel(ShardedDataParallelBase):
    """ZeRO-1 / ZeRO-2 over ``mesh.group("dp_shard_cp")`` (plus ``dp_replicate`` for HSDP); the
    expert parameters of an expert-parallel model over ``edp_shard`` (plus ``dp_replicate``).

    Args:
        module: the model, full parameters in the master dtype (fp32 / fp64), equal on all ranks.
        mesh: the ``Mesh``.
        stage: 1 or 2.
        bucket_size_bytes: bucket size in reduce-dtype bytes.
        compute_dtype: dtype the model's parameters are cast to (None = master dtype).
        reduce_dtype: dtype of gradient reductions (None = master dtype).
        expert_names: the expert parameters (``apply_ep``'s names; empty without expert parallel).
    Raises ValueError for another stage or parameters of mixed dtypes.
    Instrumentation: ``observers`` (``observe.py``) sees ``on_state`` when a gradient arrives and
    when a bucket's reduce-scatter starts.
    """

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
        """Cut each bucket in two where it mixes dense and expert parameters (the part holding
        the bucket's first parameter first): a bucket reduces over one group."""
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
        """ZeRO-1: accumulate full gradients locally (they are reduced once, in
        ``finish_grad_sync``, anyway). ZeRO-2 reduces every microbatch (never holding a full
        gradient), so this is a no-op for it too."""
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
        """Reduce what is left (ZeRO-1: everything), all-reduce over ``dp_replicate``, and hand
        the gradient shards to the master parameters (``entry.param.grad``)."""
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
        """Tensors held per category (``ndtrain.mem_account``): model params (compute dtype),
        gradients (full ones not yet reduced, shards), optimizer state (masters + moments)."""
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
