"""Measure what the CPU eager step-time and RSS models need (``planner/eager_time.py``,
``planner/calibrate.py``): component times of the model's eager training step at the run's shapes,
threads and concurrent ranks, and the framework baseline of a rank's resident memory.

Both spawn fresh processes (``ndtrain.spawn``) so that the measurement sees what a
rank of ``ndtrain train`` sees: its own thread count, the other ranks running at the same time,
and an interpreter that imported only what a rank imports.
"""
from __future__ import annotations

import statistics

from ndtrain.calibration.measure_ep import ep_moe_seconds, median_seconds


def _component_seconds(make, reps: int, pool_bytes: int):
    """Median seconds of one forward + backward (and of the forward alone) of ``make(i)`` -> (fn,
    inputs); inputs rotate over a pool larger than the last-level cache, as in a training step."""
    import torch

    first = make(0)
    per = sum(t.numel() * t.element_size() for t in first[1])
    sets = [first] + [make(i) for i in range(1, max(2, pool_bytes // max(per, 1)))]

    def run(backward: bool):
        keep = []
        for fn, ins in sets:
            out = fn(*ins)
            if backward:
                out.backward(torch.ones_like(out))
            keep.append(out.detach())
            if len(keep) > 4:
                keep.pop(0)

    run(True)
    return median_seconds(lambda: run(True), reps) / len(sets), median_seconds(lambda: run(False), reps) / len(sets)


def _eager_rates_worker(rank, world, shapes, dims, params, dtype, threads, reps, cp=1, moe=None,
                        pool_bytes=96 * 2**20, tp=1, ep=1):
    import torch
    import torch.nn.functional as F

    from ndtrain.model.norm import RMSNorm
    from ndtrain.model.rope import apply_rope

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(rank)
    b, T, H, G, D, h, f, V = dims
    tokens = b * T
    out = {}
    gemm_t, gemm_f = 0.0, 0.0
    for k, n, count in shapes:  # forward x W^T, grad input g W, grad weight g^T x
        x, w, gr = (torch.randn(a, c, generator=g, dtype=dt) for a, c in ((tokens, k), (n, k), (tokens, n)))
        ops = (lambda x=x, w=w: x @ w.t(), lambda gr=gr, w=w: gr @ w, lambda gr=gr, x=x: gr.t() @ x)
        for op in ops:
            op()
        gemm_t += count * sum(median_seconds(op, reps) for op in ops)
        gemm_f += count * 6.0 * tokens * k * n
    out.update(gemm_flops_per_s=gemm_f / gemm_t, gemm_s=gemm_t)

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=g, dtype=dt).requires_grad_(grad)

    norm = RMSNorm(h).to(dt)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    labels = torch.randint(0, V, (tokens,), generator=g)
    comps = {  # name: make(i) -> (fn, inputs); shapes as in ndtrain.model
        "attn": lambda i: (lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=H != G),
            (rnd(b, T, H, D), rnd(b, T, G, D), rnd(b, T, G, D))),
        "norm": lambda i: (norm, (rnd(b, T, h),)),
        "rope": lambda i: (lambda q, k: torch.cat([apply_rope(q, cos, sin).flatten(2), apply_rope(k, cos, sin).flatten(2)], -1),
                           (rnd(b, T, H, D), rnd(b, T, G, D))),
        "swiglu": lambda i: (lambda x, y: F.silu(x) * y, (rnd(b, T, f), rnd(b, T, f))),
        "residual": lambda i: (lambda x, y: x + y, (rnd(b, T, h), rnd(b, T, h))),
        "loss": lambda i: (lambda z: F.cross_entropy(z, labels, reduction="sum"), (rnd(tokens, V),)),
    }
    for name, make in comps.items():
        out[f"{name}_s"], out[f"{name}_fwd_s"] = _component_seconds(make, reps, pool_bytes)
    if cp > 1:
        out["ring_attn_s"] = _ring_attention_seconds(cp, b, T, H, G, D, dt, g, reps)
    if moe:  # the MoE layer as the rank runs it (through the EP module when ep > 1)

        out.update(ep_moe_seconds(moe, ep, b, T, dt, g, reps))
    if tp > 1:
        for name, make in _tp_components(tp, b, T, h, V, rnd).items():
            out[f"{name}_s"], out[f"{name}_fwd_s"] = _component_seconds(make, reps, pool_bytes)
    out.update(_param_pass_seconds(params, dt, reps))
    return out


def _tp_components(tp: int, b: int, T: int, h: int, v_local: int, rnd) -> dict:
    """The tensor-parallel layers' own eager work on one rank, their collectives off (an
    ``AxisGroup`` of ``tp`` ranks without a process group: ``parallel.comm`` then returns at once):
    ``tp_region``: Megatron's f and g around one region (``CopyToTP`` then ``ReduceFromTP`` on a
    (b, T, h) activation: g's forward and f's backward each copy it for the all-reduce), two per
    block; ``tp_loss``: ``vocab_parallel_cross_entropy`` on the rank's (b T, V / tp) logits (max,
    exp, sums, gather, the softmax kept for backward), in place of the single-device loss;
    ``tp_embed``: ``VocabParallelEmbedding`` on (b, T) tokens (range masks, the lookup, masked
    rows, the dense (V / tp, h) weight gradient) on the first stage."""
    import torch

    from ndtrain.mesh import AxisGroup
    from ndtrain.parallel.tp.collectives import CopyToTP, ReduceFromTP
    from ndtrain.parallel.tp.layers import VocabParallelEmbedding
    from ndtrain.parallel.tp.vocab_loss import vocab_parallel_cross_entropy

    grp = AxisGroup("tp", tp, 0, None)
    gen = torch.Generator().manual_seed(tp)
    y = torch.randint(0, v_local * tp, (b * T,), generator=gen)  # (b T,) about 1 / tp of them local
    toks = torch.randint(0, v_local * tp, (b, T), generator=gen)

    def embed(i):
        emb = VocabParallelEmbedding(torch.nn.Parameter(rnd(v_local, h).detach()), 0, grp, False)
        return (lambda w: emb(toks)), (emb.weight,)

    return {"tp_region": lambda i: (lambda x: ReduceFromTP.apply(CopyToTP.apply(x, grp), grp), (rnd(b, T, h),)),
            "tp_loss": lambda i: (lambda z: vocab_parallel_cross_entropy(z, y, grp, v_local * tp).sum(),
                                  (rnd(b * T, v_local),)),
            "tp_embed": embed}


def _ring_attention_seconds(cp: int, b: int, t_local: int, H: int, G: int, D: int, dt, g, reps: int) -> float:
    """Seconds of one rank's ring attention compute per layer, forward + backward: the ring's own
    block, merge and block-backward functions (``cp.ring.simulate_ring_attention`` runs every
    rank's blocks in ring order, load-balanced layout) divided by cp (the ranks' work is equal)."""
    import torch

    from ndtrain.parallel.cp.context_parallel import local_positions
    from ndtrain.parallel.cp.ring import simulate_ring_attention

    pos = torch.stack([local_positions(t_local * cp, cp, r, "load_balanced") for r in range(cp)])  # (cp, T/cp)
    def per_rank(heads):  # one (b, heads, T/cp, D) tensor per rank
        return [torch.randn(b, heads, t_local, D, generator=g, dtype=dt) for _ in range(cp)]

    qs, ks, vs, dos = per_rank(H), per_rank(G), per_rank(G), per_rank(H)

    def run():
        _, backward = simulate_ring_attention(qs, ks, vs, pos, pos, causal=True)
        backward(dos)

    run()
    return median_seconds(run, reps) / cp


def _param_pass_seconds(shapes, dt, reps: int) -> dict:
    """Seconds per parameter of the trainer's per-parameter passes over tensors of ``shapes``:
    AdamW (fused or foreach, as ``ndtrain.optim.build_optimizer`` chooses for plain tensors), the
    global-norm clip (``ndtrain.optim.clip_grad_norm``), gradient accumulation (``add_``) and a
    flatten + copy back (data-parallel buckets / ZeRO packs)."""
    import torch

    from ndtrain.optim import clip_grad_norm, fused_adamw_ok

    ps = [torch.nn.Parameter(torch.randn(s, dtype=dt)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    other = [torch.randn_like(p) for p in ps]
    n = sum(p.numel() for p in ps)
    impl = {"fused": True} if fused_adamw_ok(ps) else {"foreach": True}
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, **impl)
    opt.step()

    def flat():
        buf = torch.cat([p.grad.reshape(-1) for p in ps])
        off = 0
        for p in ps:
            p.grad.copy_(buf[off:off + p.numel()].view_as(p))
            off += p.numel()

    runs = {"optim": opt.step, "clip": lambda: clip_grad_norm([(p.grad, ()) for p in ps], 1e-9),
            "accum": lambda: torch._foreach_add_([p.grad for p in ps], other), "copy": flat}
    return {f"{k}_s_per_param": median_seconds(fn, reps) / n for k, fn in runs.items()}
def measure_eager_rates(spec, microbatch: int, seq_len: int, threads: int = 1, world: int = 1,
                        dtype: str = "float32", reps: int = 5, timeout_s: float = 300.0, cp: int = 1,
                        moe_model: dict | None = None, tp: int = 1, ep: int = 1) -> dict:
    """Kernel times of ``spec``'s eager training step on this machine, for the step-time model of
    ``planner.eager_time``: ``world`` processes with ``threads`` threads each run at the same time
    (as the ranks of the layout do) and each times, at the run's shapes (microbatch x seq_len
    tokens): the model's matmuls (forward and both backward products; ``gemm_flops_per_s``), and
    forward + backward (``<name>_s``) and forward alone (``<name>_fwd_s``) of the model's other
    components: causal GQA attention core, RMSNorm, RoPE of q and k, SiLU(g) * u, a residual add,
    the cross-entropy over V; inputs rotate over a pool larger than the last-level cache. Then the
    per-parameter passes (``optim`` / ``clip`` / ``accum`` / ``copy_s_per_param``). With ``cp`` > 1
    (``seq_len`` is then the rank's T / cp) also ``ring_attn_s``: one rank's ring attention per
    layer (``_ring_attention_seconds``). With ``moe_model`` (a ``ModelConfig`` as a dict) also
    ``moe_mlp_s``: the model's MoE feed-forward at the run's tokens, with ``ep`` > 1 through the
    expert-parallel module, and then ``moe_experts_s``, its local experts alone
    (``measure_ep.ep_moe_seconds``). With ``tp`` >
    1 (``spec`` is then one TP rank's, ``eager_axes_time.rate_spec``) also ``tp_region_s``,
    ``tp_loss_s`` and ``tp_embed_s``: the TP layers' own work, collectives off (``_tp_components``). Medians over
    ``reps``; the result is the median over processes. Raises RuntimeError if a worker fails or
    times out.
    """
    from ndtrain.calibration.eager_time import linear_shapes
    from ndtrain.planner.eager import param_shapes
    from ndtrain.spawn import spawn

    dims = (microbatch, seq_len, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_hidden,
            spec.vocab_size)
    args = (linear_shapes(spec), dims, [sh for _, sh in param_shapes(spec)], dtype, threads, reps, cp, moe_model,
            96 * 2**20, tp, ep)
    # no process group: the ranks only run at the same time, as a layout's ranks compete for cores
    outs = spawn(_eager_rates_worker, world, args, threads=threads, timeout_s=timeout_s)
    return {k: statistics.median(o[k] for o in outs) for k in outs[0]} | {"threads": threads, "world": world}


def _baseline_worker(rank, world, cfg_dict, prepare):
    import resource

    import torch

    from ndtrain.config import config_from_dict
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.loop import Trainer

    cfg = config_from_dict(cfg_dict)
    if prepare:  # a one-process `ndtrain train` prepares (cached) data in the training process
        from ndtrain.data import GlobalBatchSampler, TokenData, prepare_data

        data = TokenData(prepare_data(cfg.data, cfg.model.vocab_size))
        GlobalBatchSampler(data.num_sequences("train", cfg.data.seq_len), cfg.training.global_batch_size, 0)
    m = cfg.model  # the same trainer, layout and dtype around a negligible model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden = 16, 1, 2, 1, 32
    m.n_layers = cfg.parallel.pp * cfg.parallel.pp_virtual_stages  # one block per pipeline chunk
    dims = ParallelDims.from_config(cfg.parallel, world)
    tr = Trainer(cfg, dims.build_mesh("cpu"), torch.device("cpu"))
    b, T = tr.local_batch, cfg.data.seq_len
    x = torch.randint(0, m.vocab_size, (b, T + 1), generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        tr.measure_memory = step == 0
        tr.step(x[:, :-1], x[:, 1:])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_trainer_baseline_rss(cfg, world: int = 1, threads: int = 1, prepare_data: bool | None = None,
                                 timeout_s: float = 300.0) -> float:
    """The framework baseline of a CPU run's max RSS (bytes, max over ranks): ``world`` fresh
    processes (gloo when world > 1) that do what a rank of ``ndtrain train`` does around the model
    (import torch and ndtrain, open the cached data when one process trains, build the trainer for
    ``cfg``'s layout and dtype, two steps with the memory meter on the first) but with a negligible
    model (dim 16, 1 layer). What it does not contain is model state and activations, which the
    planner predicts. Raises RuntimeError if a worker fails or times out.
    """
    from ndtrain.spawn import spawn

    prepare = world == 1 if prepare_data is None else prepare_data
    outs = spawn(_baseline_worker, world, (cfg.to_dict(), prepare), backend="gloo" if world > 1 else None,
                 threads=threads, timeout_s=timeout_s)
    return float(max(outs))
