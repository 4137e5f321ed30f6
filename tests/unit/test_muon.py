"""Single-process Muon: parameter groups by name and shape, and 3 steps equal a hand-written
reference step in float64 (Nesterov momentum, quintic Newton-Schulz, update scale, decoupled weight
decay; AdamW on the rest, equal to torch.optim.AdamW)."""
import math

import pytest
import torch
from torch import nn

from ndtrain.config import TrainingConfig
from ndtrain.errors import ConfigError
from ndtrain.optim.muon import build_muon, muon_param_kind, update_scale
from ndtrain.parallel.muon.rules import check

PATTERNS = TrainingConfig().muon_adamw_patterns


@pytest.mark.parametrize("name,shape,kind", [
    ("layers.0.attention.wq.weight", (64, 64), "muon"),
    ("layers.0.feed_forward.w2.weight", (64, 128), "muon"),
    ("layers.0.feed_forward.experts.w1", (8, 128, 64), "muon"),
    ("layers.0.attention.out_proj.weight", (64, 128), "muon"),
    ("mtp.0.proj.weight", (64, 128), "muon"),
    ("tok_embeddings.weight", (512, 64), "adamw"),
    ("output.weight", (512, 64), "adamw"),
    ("layers.0.feed_forward.router.weight", (8, 64), "adamw"),
    ("layers.0.attention.conv1d.weight", (128, 1, 4), "adamw"),
    ("layers.0.attention_norm.weight", (64,), "adamw"),
    ("layers.0.attention.A_log", (4,), "adamw"),
])
def test_param_kinds(name, shape, kind):
    assert muon_param_kind(name, shape, PATTERNS) == kind


def test_patterns_are_configurable():
    assert muon_param_kind("layers.0.attention.wq.weight", (64, 64), "*.wq.*") == "adamw"
    assert muon_param_kind("output.weight", (512, 64), "") == "muon"


def test_scales():
    assert update_scale(64, 256, "moonlight") == pytest.approx(0.2 * 16)
    assert update_scale(256, 64, "original") == pytest.approx(2.0)
    assert update_scale(64, 256, "original") == 1.0


@pytest.mark.parametrize("key,value,msg", [
    ("optimizer", "sgd", "training.optimizer (sgd) must be one of adamw | muon"),
    ("muon_scale", "x", "training.muon_scale (x) must be one of moonlight | original"),
    ("muon_ns_steps", 0, "training.muon_ns_steps (0) must be >= 1"),
    ("muon_momentum", 1.0, "training.muon_momentum (1.0) must be in [0, 1)"),
])
def test_rules(key, value, msg):
    with pytest.raises(ConfigError) as e:
        check(TrainingConfig(**{key: value}))
    assert str(e.value) == msg


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        mk = lambda *s: nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64))
        self.tok_embeddings = nn.ParameterDict({"weight": mk(10, 6)})
        self.wq = nn.ParameterDict({"weight": mk(8, 6)})  # wide after transpose: tall
        self.w2 = nn.ParameterDict({"weight": mk(6, 9)})
        self.experts = nn.ParameterDict({"w1": mk(3, 4, 6)})
        self.norm = nn.ParameterDict({"weight": mk(6)})


def _ref_ns(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic of Jordan et al. written out for one matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    t = x.shape[0] > x.shape[1]
    x = x.T if t else x
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        aa = x @ x.T
        x = a * x + b * (aa @ x) + c * (aa @ aa @ x)
    return x.T if t else x


@pytest.mark.parametrize("scale", ["moonlight", "original"])
def test_three_steps_equal_the_hand_written_step(scale):
    cfg = TrainingConfig(optimizer="muon", lr=1e-2, muon_lr=0.03, muon_momentum=0.9, weight_decay=0.1,
                         muon_scale=scale, muon_ns_steps=5, beta1=0.9, beta2=0.95, eps=1e-8,
                         muon_adamw_patterns="tok_embeddings.*")
    model = Tiny()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_muon(model.named_parameters(), cfg)
    kinds = {n: g["kind"] for g in opt.param_groups for n, p in model.named_parameters()
             if any(p is q for q in g["params"])}
    assert kinds == {"tok_embeddings.weight": "adamw", "wq.weight": "muon", "w2.weight": "muon",
                     "experts.w1": "muon", "norm.weight": "adamw"}
    buf = {n: torch.zeros_like(p) for n, p in ref.items()}
    m1 = {n: torch.zeros_like(p) for n, p in ref.items()}
    m2 = {n: torch.zeros_like(p) for n, p in ref.items()}
    torch_adamw_p = {n: nn.Parameter(ref[n].clone()) for n in ("tok_embeddings.weight", "norm.weight")}
    torch_adamw = torch.optim.AdamW([{"params": [torch_adamw_p["tok_embeddings.weight"]], "weight_decay": 0.1},
                                     {"params": [torch_adamw_p["norm.weight"]], "weight_decay": 0.0}],
                                    lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for t in range(1, 4):
        grads = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in ref.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for n, p in torch_adamw_p.items():
            p.grad = grads[n].clone()
        opt.step()
        torch_adamw.step()
        for n, w in ref.items():
            gr = grads[n]
            if kinds[n] == "muon":
                buf[n] = 0.9 * buf[n] + gr
                u = gr + 0.9 * buf[n]
                mats = [u] if u.dim() == 2 else list(u)
                o = torch.stack([_ref_ns(x, 5) for x in mats]).reshape(u.shape)
                rows, cols = w.shape[-2:]
                s = 0.2 * math.sqrt(max(rows, cols)) if scale == "moonlight" else math.sqrt(max(1, rows / cols))
                ref[n] = w * (1 - 0.03 * 0.1) - 0.03 * s * o
            else:
                wd = 0.1 if w.dim() >= 2 else 0.0
                m1[n] = 0.9 * m1[n] + 0.1 * gr
                m2[n] = 0.95 * m2[n] + 0.05 * gr * gr
                mh, vh = m1[n] / (1 - 0.9 ** t), m2[n] / (1 - 0.95 ** t)
                ref[n] = w * (1 - 1e-2 * wd) - 1e-2 * mh / (vh.sqrt() + 1e-8)
        for n, p in model.named_parameters():
            assert (p.detach() - ref[n]).abs().max() < 1e-12, (t, n)
        for n, p in torch_adamw_p.items():
            assert (p.detach() - ref[n]).abs().max() < 1e-12, (t, n)
    st = opt.state[model.wq["weight"]]
    assert set(st) == {"step", "momentum_buffer"} and float(st["step"]) == 3
    assert torch.allclose(st["momentum_buffer"], buf["wq.weight"], rtol=0, atol=1e-13)


def test_muon_lr_zero_means_lr_and_the_schedule_scales_both():
    from ndtrain.optim import build_scheduler

    cfg = TrainingConfig(optimizer="muon", lr=1e-3, muon_lr=0.0, warmup_steps=4, steps=10)
    model = Tiny()
    opt = build_muon(model.named_parameters(), cfg)
    assert {g["kind"]: g["lr"] for g in opt.param_groups} == {"adamw": 1e-3, "muon": 1e-3}
    cfg.muon_lr = 0.02
    opt = build_muon(model.named_parameters(), cfg)
    sched = build_scheduler(opt, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    sched.step()
    assert {g["kind"]: g["lr"] for g in opt.param_groups} == {"adamw": pytest.approx(1e-3 * 2 / 4),
                                                             "muon": pytest.approx(0.02 * 2 / 4)}


def test_ns_flops_per_step_single_process():
    from ndtrain.ops.newton_schulz import ns_flops

    model = Tiny()
    opt = build_muon(model.named_parameters(), TrainingConfig(optimizer="muon", muon_adamw_patterns="tok_embeddings.*"))
    assert opt.ns_flops_per_step() == ns_flops(8, 6) + ns_flops(6, 9) + ns_flops(4, 6, batch=3)


def _trainer(**training):
    from ndtrain.config import validate
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.trainer import Trainer
    from tests.parallel.layout_parity import tiny_cfg

    cfg = tiny_cfg(1)
    cfg.training.optimizer = "muon"
    for k, v in training.items():
        setattr(cfg.training, k, v)
    validate(cfg, 1)
    return Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))


def test_a_bad_step_leaves_weights_and_momentum_untouched():
    from tests.parallel.layout_parity import global_batch

    tr = _trainer()
    tr.nan_steps = frozenset({2})
    tr.step(*global_batch(0))
    snap = {id(p): (p.detach().clone(), {k: v.clone() for k, v in tr.optimizer.state[p].items()})
            for g in tr.optimizer.param_groups for p in g["params"]}
    out = tr.step(*global_batch(1))
    assert out["bad_step"]
    for g in tr.optimizer.param_groups:
        for p in g["params"]:
            w, st = snap[id(p)]
            assert torch.equal(p.detach(), w) and all(torch.equal(tr.optimizer.state[p][k], v) for k, v in st.items())
    assert not tr.step(*global_batch(2))["bad_step"]
    wq = tr.model.layers["0"].attention.wq.weight
    assert float(tr.optimizer.state[wq]["step"]) == 2 and not torch.equal(wq.detach(), snap[id(wq)][0])


def test_bf16_autocast_keeps_fp32_masters_and_trains():
    from tests.parallel.layout_parity import global_batch

    tr = _trainer(dtype="bfloat16")
    wq = tr.model.layers["0"].attention.wq.weight
    assert wq.dtype == torch.float32 and tr.optimizer.state[wq]["momentum_buffer"].dtype == torch.float32
    losses = [tr.step(*global_batch(s % 2))["loss"] for s in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_fp16_overflow_skips_the_muon_step_until_the_scale_fits():
    from tests.parallel.layout_parity import global_batch

    tr = _trainer(dtype="float16", loss_scale_init=2.0 ** 24)
    wq = tr.model.layers["0"].attention.wq.weight
    flags = []
    for s in range(16):
        before, buf = wq.detach().clone(), tr.optimizer.state[wq]["momentum_buffer"].clone()
        out = tr.step(*global_batch(s % 4))
        flags.append(out["skipped"])
        unchanged = torch.equal(wq.detach(), before) and torch.equal(tr.optimizer.state[wq]["momentum_buffer"], buf)
        assert unchanged == out["skipped"], s
    assert flags[0] and not flags[-1]


def test_resume_keeps_the_optimizer():
    from ndtrain.parallel.muon.rules import check_resume

    check_resume({}, TrainingConfig())  # an older run dir without the key: adamw
    check_resume({"optimizer": "muon"}, TrainingConfig(optimizer="muon"))
    with pytest.raises(ConfigError) as e:
        check_resume({}, TrainingConfig(optimizer="muon"))
    assert str(e.value) == ("training.optimizer ('adamw' -> 'muon') cannot change on resume: the checkpoints hold "
                            "the other optimizer state; keep it, or use a new --run-dir")
    with pytest.raises(ConfigError, match=r"training.muon_adamw_patterns \('x' -> "):
        check_resume({"optimizer": "muon", "muon_adamw_patterns": "x"}, TrainingConfig(optimizer="muon"))


def test_the_metrics_row_adds_newton_schulz_flops_to_hfu_not_mfu():
    from types import SimpleNamespace

    from ndtrain.mesh import ParallelDims
    from ndtrain.train import loop, metrics
    from tests.parallel.layout_parity import tiny_cfg

    cfg = tiny_cfg(1)
    model = Tiny()
    for opt, ns in ((build_muon(model.named_parameters(), TrainingConfig(optimizer="muon")), True),
                    (torch.optim.SGD(model.parameters(), lr=0.1), False)):
        r = SimpleNamespace(cfg=cfg, mesh=ParallelDims(world_size=1).build_mesh(), device=torch.device("cpu"),
                            world=1, trainer=SimpleNamespace(optimizer=opt), data=None, sampler=None)
        out = {"loss": 1.0, "lr": 0.1, "grad_norm": 1.0}
        row = loop._log_row(r, 10, out, [2.0, 4], fpt=1e6, peak=1e9)  # 4 steps in 2 s
        tps = 4 * cfg.training.global_batch_size * cfg.data.seq_len / 2.0
        assert row["mfu"] == pytest.approx(1e6 * tps / 1e9)
        hfu = row["mfu"] * metrics.hfu_factor(cfg.model, cfg.data.seq_len, "none")
        extra = opt.ns_flops_per_step() * 4 / 2.0 / 1e9 if ns else 0.0
        assert row["hfu"] == pytest.approx(hfu + extra) and (extra > 0) == ns


def test_newton_schulz_dtype_is_bf16_on_cuda_and_the_run_dtype_on_cpu():
    """The choice (``ns_dtype``): bfloat16 for CUDA tensors (a stand-in object: no GPU here), the
    tensor's own dtype on CPU; and on CPU the float64 orthogonalisation is the float64 iteration,
    ~1e-3 away from what a bf16 one gives."""
    from types import SimpleNamespace

    from ndtrain.ops.newton_schulz import newton_schulz
    from ndtrain.optim.muon import local_orthogonalize, ns_dtype

    for dt in (torch.float64, torch.float32, torch.bfloat16):
        assert ns_dtype(torch.zeros(2, 2, dtype=dt)) == dt
        assert ns_dtype(SimpleNamespace(is_cuda=True, dtype=dt)) == torch.bfloat16
    u = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (o,) = local_orthogonalize([u], [u], 5)
    assert o.dtype == torch.float64 and torch.equal(o, newton_schulz(u, 5, torch.float64))
    assert (o - newton_schulz(u, 5, torch.bfloat16)).abs().max() > 1e-3
