"""Execution modes of the planner (``planner/exec_mode.py``): the eager kernel and byte counts are
what ndtrain's own ops run, recounted here by a dispatch-mode counter on CPU in bf16, and the
eager / compiled step times land within 10% of torchtitan's published Llama 3 8B figures.

Bytes per element are the mixed second difference of the counted bytes over (tokens, width):
B(2N, 2W) - B(N, 2W) - B(2N, W) + B(N, W) = a N W exactly, whatever the per-row (N) and per-weight
(W) terms, so the test pins the coefficient the planner uses and nothing it leaves out."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ndtrain.planner.exec_mode import EAGER, FUSED, MODES, block_ops, op_table
from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Workload, check_layout, parse_layout
from ndtrain.planner.model_spec import from_model_config, load_model_spec
from ndtrain.planner.timing import estimate_step_time

DENSE = {"mm", "addmm", "bmm", "baddbmm"}  # GEMMs: the same kernels in every mode


def _real_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: broadcast (stride 0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


class _Counter(TorchDispatchMode):
    """Every non-view aten op outside GEMMs and attention: (name, bytes read + written)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        name = func.overloadpacket.__name__
        ptrs = {a.untyped_storage().data_ptr() for a in ins}
        view = outs and all(o.untyped_storage().data_ptr() in ptrs for o in outs)
        if not view and name not in DENSE and "scaled_dot_product" not in name:
            self.ops.append((name, sum(map(_real_bytes, ins)) + sum(map(_real_bytes, outs))))
        return out


def _count(fn, *inputs):
    """((forward kernels, bytes), (backward kernels, bytes)) of ``fn(*inputs)`` and its backward."""
    with _Counter() as f:
        y = fn(*inputs)
    grad = torch.ones_like(y)
    with _Counter() as b:
        y.backward(grad)
    return [(len(c.ops), sum(n for _, n in c.ops)) for c in (f, b)]


def _bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)


def _norm(n, w):
    from ndtrain.model.norm import RMSNorm

    return _count(RMSNorm(w).to(torch.bfloat16), _bf16(n, w))


def _rope(n, w):  # w = head dim D, 4 heads, 8 positions
    from ndtrain.model.rope import apply_rope

    cos, sin = torch.randn(8, w // 2), torch.randn(8, w // 2)
    return _count(lambda x: apply_rope(x, cos, sin), _bf16(n // 8, 8, 4, w))


def _swiglu(n, w):
    from ndtrain.model.mlp import _silu_gate

    return _count(_silu_gate, _bf16(n, w), _bf16(n, w))


def _loss(n, w):  # what parallel.batch's loss_sum runs on one rank
    y = torch.randint(0, w, (n,), generator=torch.Generator().manual_seed(0))
    return _count(lambda z: F.cross_entropy(z, y, reduction="sum"), _bf16(n, w))


def _per_element(case, n=32, w=64, per=1):
    """(kernels, bytes per element) forward and backward: the mixed second difference."""
    got = {(a, b): case(a * n, b * w) for a in (1, 2) for b in (1, 2)}
    out = []
    for i in (0, 1):
        kernels = {v[i][0] for v in got.values()}
        assert len(kernels) == 1  # the kernel count does not depend on the shape
        mixed = got[2, 2][i][1] - got[1, 2][i][1] - got[2, 1][i][1] + got[1, 1][i][1]
        out.append((kernels.pop(), mixed / (n * w * per)))
    return out


@pytest.mark.parametrize("op, case, per", [("rmsnorm", _norm, 1), ("rope", _rope, 4), ("swiglu", _swiglu, 1),
                                           ("cross_entropy", _loss, 1)])
def test_eager_table_is_what_ndtrain_ops_run(op, case, per):
    (kf, bf), (kb, bb) = _per_element(case, per=per)
    t = EAGER[op]
    assert (kf, bf, kb, bb) == (t.fwd_kernels, t.fwd_bytes, t.bwd_kernels, t.bwd_bytes)
    assert bf + bb > FUSED[op].fwd_bytes + FUSED[op].bwd_bytes  # eager always moves more


def _block(batch, scale):
    from ndtrain.model.block import TransformerBlock
    from ndtrain.model.rope import rope_tables
    from tests.utils import tiny_config

    cfg = tiny_config({"model.dim": 32 * scale, "model.n_heads": 4, "model.n_kv_heads": 2,
                       "model.ffn_hidden": 48 * scale, "model.max_seq_len": 16, "model.vocab_size": 64})
    blk = TransformerBlock(cfg.model, "0").to(torch.bfloat16)
    cos, sin = rope_tables(cfg.model)
    x = _bf16(batch, 16, cfg.model.dim)
    return from_model_config(cfg.model), _count(lambda t: blk(t, cos[:16], sin[:16]), x)


def test_a_block_is_the_sum_of_the_modelled_ops():
    """A whole bf16 GQA block (norms, RoPE, SwiGLU, residuals and autograd's summed gradients of
    inputs read twice): every kernel outside GEMMs and attention is one the table names, and its
    bytes per (token x width) are the table's sum."""
    got = {(b, s): _block(b, s) for b in (1, 2) for s in (1, 2)}
    spec, counts = got[1, 1]
    ops = block_ops(spec, 16, 1, False, False)
    for i, (kern, byt) in enumerate((("fwd_kernels", "fwd_bytes"), ("bwd_kernels", "bwd_bytes"))):
        want_k = sum(calls * getattr(EAGER[op], kern) for op, (_, calls) in ops.items())
        assert counts[i][0] == want_k
        mixed = got[2, 2][1][i][1] - got[1, 2][1][i][1] - got[2, 1][1][i][1] + counts[i][1]
        assert mixed == sum(getattr(EAGER[op], byt) * el for op, (el, _) in ops.items())


TITAN = "dp_shard=8,zero_stage=3,ac=selective,microbatch=1"


def _titan(mode):
    """torchtitan's Llama 3 8B benchmark: 8 H100 (96 GB parts at ~835 bf16 TFLOP/s; bandwidth as the
    H100-96GB entry), FSDP, selective AC, sequence 8192, local batch 1: tokens / s / GPU."""
    spec, _ = load_model_spec("llama3_8b")
    acc = get_accelerator("H100-96GB")
    acc = replace(acc, peak_flops_per_s={**acc.peak_flops_per_s, "bfloat16": 835e12, "float16": 835e12})
    st = estimate_step_time(spec, Cluster(acc, 8), Workload(8192, 8 * 8192), parse_layout(f"{TITAN},mode={mode}"))
    return 8192 / st.step_time_s, st


@pytest.mark.parametrize("mode, published", [("eager", 5762), ("compile", 6667)])
def test_torchtitan_llama3_8b_eager_and_compile_within_10pct(mode, published):
    tps, _ = _titan(mode)
    assert tps == pytest.approx(published, rel=0.10), tps


def test_modes_differ_only_in_the_memory_bound_ops():
    (_, eager), (_, kern), (_, comp) = (_titan(m) for m in ("eager", "kernels", "compile"))
    assert eager.compute_s["gemm"] == comp.compute_s["gemm"] and eager.compute_s["attention"] == comp.compute_s["attention"]
    assert eager.compute_s["memory_bound"] > kern.compute_s["memory_bound"] > comp.compute_s["memory_bound"] > 0
    assert eager.step_time_s / comp.step_time_s > 1.05  # torchtitan measured 1.157


def test_unknown_mode_is_a_rule_not_a_crash():
    spec, _ = load_model_spec("llama3_8b")
    lay = parse_layout("dp_shard=8,mode=jit")
    assert check_layout(spec, 8, Workload(8192, 8 * 8192), lay) == [f"mode (jit) must be one of {MODES}"]
    with pytest.raises(ValueError, match="execution mode 'jit'"):
        op_table("jit")
    assert str(parse_layout("dp_shard=8,mode=eager")).endswith(",mode=eager")
    assert "mode" not in str(parse_layout("dp_shard=8"))


def test_cli_layout_mode_eager_is_slower_and_round_trips(capsys):
    """``ndtrain plan --layout ...,mode=eager``: the mode reaches the time model (slower than the
    default compiled mode) and the printed layout names it."""
    import json

    from ndtrain.cli.plan import main

    base = ["--model", "llama3_8b", "--hardware", "H100", "--gpus", "8", "--json", "--layout"]
    times = {}
    for mode in ("compile", "eager"):
        assert main(base + [f"dp_shard=8,zero_stage=3,ac=full,microbatch=1,mode={mode}"]) == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        times[mode] = row["step_time_s"]
        assert ("mode=eager" in row["layout"]) == (mode == "eager")
    assert times["eager"] > times["compile"]


def test_cli_mode_flag_sets_the_search_and_a_layout_without_mode(capsys):
    """``--mode eager``: every searched layout and a ``--layout`` without ``mode=`` are costed eager
    (slower than compiled); a layout naming another mode is refused with exit 2."""
    import json

    from ndtrain.cli.plan import main

    base = ["--model", "llama3_8b", "--hardware", "H100", "--gpus", "8", "--json"]
    lay = ["--layout", "dp_shard=8,zero_stage=3,ac=full,microbatch=1"]
    got = {}
    for mode in ("compile", "eager"):
        assert main(base + lay + ["--mode", mode]) == 0
        got[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "mode=eager" in got["eager"]["layout"] and "mode" not in got["compile"]["layout"]
    assert got["eager"]["step_time_s"] > got["compile"]["step_time_s"]
    assert main(base + ["--layout", "dp_shard=8,mode=compile", "--mode", "eager"]) == 2
    assert "contradicts the layout's mode=compile" in capsys.readouterr().err
    assert main(base + ["--mode", "eager", "--top", "3"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines() if ln.startswith("{")]
    assert rows and all("mode=eager" in r["layout"] for r in rows if "layout" in r)
