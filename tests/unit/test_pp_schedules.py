"""Pipeline schedules, stage split and visualizer, in pure Python (no process group).

The schedule checks simulate the runtime's semantics (receives posted ahead, sends never block):
every action runs once, every F before its own B (and B before W), each action after the actions
of other stages it needs, no deadlock for any timing, and the planned bubble equals the textbook
formula exactly where the formula applies (rational arithmetic on unit times, so equality is
tested to 1e-12).
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from ndtrain.config import ConfigError, load_config
from ndtrain.parallel.pp.schedules import SCHEDULES, Action, bubble_formula, build_schedule
from ndtrain.parallel.pp.simulate import DeadlockError, dependencies, peak_in_flight, simulate
from ndtrain.parallel.pp.stage import layer_costs, split_layers

PS = (1, 2, 3, 4, 8)
MS = tuple(range(1, 17))


def _all(p_values=PS, m_values=MS):
    for name in SCHEDULES:
        for p in p_values:
            for m in m_values:
                for v in ((2, 3, 4) if name == "interleaved" else (1,)):
                    yield name, p, m, v


def _random_execution(s, rng: random.Random) -> None:
    """Run the per-rank orders picking a random runnable rank each time (an arbitrary timing);
    raise DeadlockError if no rank can run. Checks the order is DAG-consistent for this timing."""
    pos = [0] * s.p
    done: set[tuple[int, Action]] = set()
    total = sum(len(a) for a in s.actions)
    while len(done) < total:
        ready = [r for r in range(s.p) if pos[r] < len(s.actions[r])
                 and all(d in done for d in dependencies(s, r, s.actions[r][pos[r]]))]
        if not ready:
            raise DeadlockError("stuck", [])
        r = rng.choice(ready)
        done.add((r, s.actions[r][pos[r]]))
        pos[r] += 1


def test_every_schedule_is_complete_ordered_and_deadlock_free():
    rng = random.Random(0)
    n = 0
    for name, p, m, v in _all():
        s = build_schedule(name, p, m, v)
        simulate(s)  # raises on a missing / duplicated action or a deadlock
        for r, acts in enumerate(s.actions):
            seen = {}
            for i, a in enumerate(acts):
                seen[(a.kind, a.mb, a.chunk)] = i
            for j in range(m):
                for c in range(v):
                    assert seen[("F", j, c)] < seen[("B", j, c)], (name, p, m, v, r, j, c)
                    if s.split_backward:
                        assert seen[("B", j, c)] < seen[("W", j, c)]
        if p in (2, 4) and m in (1, 3, 8):
            for _ in range(5):  # arbitrary timings: any interleaving of runnable ranks
                _random_execution(s, rng)
        n += 1
    assert n == 4 * len(PS) * len(MS) + 2 * len(PS) * len(MS)


def test_schedules_follow_their_warmup_formulas():
    """Each rank's order is warm-up forwards, then strict F/B alternation, then backwards, with the
    warm-up of the papers: 1F1B and ZB-H1 min(p-r-1, m) (PipeDream-Flush), interleaved
    min(v m, (p-r-1)*2 + (v-1)*g) chunk-forwards, g = p + m mod p (m < p: g = m) (Megatron-LM)."""
    for name, p, m, v in _all():
        if name == "gpipe":
            continue
        s = build_schedule(name, p, m, v)
        g = m if m < p else p + m % p
        for r, acts in enumerate(s.actions):
            fb = "".join(a.kind for a in acts if a.kind != "W")
            w = min(v * m, (p - r - 1) * 2 + (v - 1) * g) if name == "interleaved" else min(p - r - 1, m)
            steady = v * m - w
            assert fb == "F" * w + "FB" * steady + "B" * w, (name, p, m, v, r, fb)


def test_cross_stage_dependencies_hold_in_the_timeline():
    """In the simulated timeline every action starts after the actions it depends on end."""
    for name, p, m, v in _all(p_values=(2, 4), m_values=(1, 3, 4, 6)):
        s = build_schedule(name, p, m, v)
        tl = simulate(s, comm=0.25)
        end = {(r, Action(e.kind, e.mb, e.chunk)): e.end for r, evs in enumerate(tl.events) for e in evs}
        for r, evs in enumerate(tl.events):
            for e in evs:
                for d in dependencies(s, r, Action(e.kind, e.mb, e.chunk)):
                    lag = 0.25 if d[0] != r else 0.0
                    assert end[d] + lag <= e.start + 1e-12


def test_blocking_sends_would_deadlock_1f1b_and_the_checker_sees_it():
    """With naive rendezvous sends (the sender waits for the receiver to reach its receive),
    1F1B deadlocks in the steady state (stage r sends F while stage r+1 sends B); GPipe does not.
    The runtime avoids this by posting receives ahead and never blocking on sends."""
    with pytest.raises(DeadlockError):
        simulate(build_schedule("1f1b", 4, 8), rendezvous=True)
    simulate(build_schedule("gpipe", 4, 8), rendezvous=True)


@pytest.mark.parametrize("name", SCHEDULES)
def test_planned_bubble_equals_formula(name):
    """GPipe / 1F1B: (p-1)/(m+p-1) for every m. Interleaved: (p-1)/(v m+p-1) for m >= p (m not a
    multiple of p included: the remainder joins the last group). ZB-H1: (p-1)/(3m+p-1) for m >= p.
    Below m = p the latter two are never worse than 1F1B's bubble."""
    for _, p, m, v in _all(p_values=(2, 3, 4, 8)):
        if _ != name:
            continue
        s = build_schedule(name, p, m, v)
        tl = simulate(s, t_f=1.0 / v, t_w=1.0 / v)
        f = bubble_formula(name, p, m, v)
        if name in ("gpipe", "1f1b") or m >= p:
            for b in tl.bubbles():
                assert abs(b - f) < 1e-12, (name, p, m, v, b, f)
        else:
            assert max(tl.bubbles()) <= bubble_formula("1f1b", p, m) + 1e-12


def test_activation_memory_bounds():
    """In-flight microbatches (activations held): GPipe m; 1F1B min(p-r, m) on rank r (at most p,
    Narayanan 2021); ZB-H1 at most min(p, m) on every rank."""
    for p in (2, 4, 8):
        for m in (1, 3, 8, 16):
            assert peak_in_flight(build_schedule("gpipe", p, m)) == [m] * p
            assert peak_in_flight(build_schedule("1f1b", p, m)) == [min(p - r, m) for r in range(p)]
            assert max(peak_in_flight(build_schedule("zero_bubble", p, m))) <= min(p, m)


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="interleaved"):
        build_schedule("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="pp_virtual_stages >= 2"):
        build_schedule("interleaved", 2, 4, v=1)
    with pytest.raises(ValueError, match="m >= 1"):
        build_schedule("gpipe", 2, 0)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("dualpipe", 2, 4)


def test_stage_split_balances_compute_like_llama3():
    """Llama 3 405B (126 layers) on pp 16: the first and last stage take 7 blocks (they also hold
    the embedding / head), the others 8 -- the split Llama 3 used."""
    cfg = load_config("llama3_405b")
    emb, blocks, head = layer_costs(cfg.model, cfg.data.seq_len)
    runs = split_layers(blocks, 16, emb, head)
    assert [len(r) for r in runs] == [7] + [8] * 14 + [7]
    assert [i for r in runs for i in r] == list(range(126))  # contiguous, each block once
    assert [len(r) for r in split_layers([1.0] * 8, 4)] == [2, 2, 2, 2]
    assert [len(r) for r in split_layers([1.0] * 8, 4, 2.0, 2.0)] == [1, 3, 3, 1]
    with pytest.raises(ValueError, match="n_layers"):
        split_layers([1.0] * 3, 4)


@pytest.mark.parametrize("overrides,world,rule", [
    ({"parallel.pp": "2", "parallel.pp_schedule": "interleaved"}, 2, r"needs pp_virtual_stages >= 2"),
    ({"parallel.pp": "2", "parallel.pp_virtual_stages": "2"}, 2, r"> 1 needs pp_schedule=interleaved"),
    ({"parallel.pp": "4", "model.n_layers": "2"}, 4, r"n_layers \(2\) < pp \* pp_virtual_stages \(4\)"),
    ({"parallel.pp": "2", "parallel.pp_microbatches": "9", "training.global_batch_size": "8"}, 2,
     r"pp_microbatches \(9\) exceeds the local batch \(8"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "zero_bubble",
      "training.activation_checkpoint": "full"}, 2, r"zero_bubble needs activation_checkpoint=none"),
])
def test_pp_config_rules(overrides, world, rule):
    with pytest.raises(ConfigError, match=rule):
        load_config("debug", overrides, world_size=world)


def test_pp_config_accepts_layouts():
    cfg = load_config("debug", {"parallel.pp": "2", "parallel.pp_schedule": "interleaved",
                                "parallel.pp_virtual_stages": "2", "model.n_layers": "4",
                                "parallel.pp_microbatches": "3"}, world_size=4)
    assert cfg.parallel.pp == 2


def test_visualizer_text_and_png(tmp_path):
    from ndtrain.parallel.pp.viz import planned_timeline, render_png, render_text

    tl = planned_timeline("1f1b", 4, 8)
    text = render_text(tl)
    rows = [ln for ln in text.splitlines() if ln.startswith("rank ") and "|" in ln]
    assert len(rows) == 4
    assert rows[0].split("|")[1].startswith("F0F1F2F3......")  # warm-up, then waiting for B0
    assert rows[3].split("|")[1].startswith("......F0B0B0F1")  # last stage: 1F1B at once
    assert "formula  27.3%" in text and "idle  27.3%" in text  # 3 / 11
    png = render_png(planned_timeline("interleaved", 4, 8, 2), tmp_path / "tl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# --- zero-bubble B / W split on one process (p = 1: no messages) ---------------------------------
class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def test_zero_bubble_split_backward_matches_full_backward():
    """B computes only input-side gradients (no parameter grads, fewer matmuls); W adds exactly the
    weight gradients: B + W = one full backward, in grads (1e-12, float64) and in matmul count."""
    from ndtrain.mesh import AxisGroup
    from ndtrain.parallel.pp.observe import ActionTimer
    from ndtrain.parallel.pp.runtime import PipelineRuntime

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16),
                        nn.Linear(16, 11)).double()
    tokens = torch.randint(0, 11, (4, 5))
    labels = torch.randint(0, 11, (4, 5))

    def loss_fn(logits, y):
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    full = _Count()
    loss = loss_fn(net(tokens), labels).div(20.0)
    with full:
        loss.backward()
    want = {n: q.grad.clone() for n, q in net.named_parameters()}
    net.zero_grad(set_to_none=True)

    rt = PipelineRuntime([net], AxisGroup("pp", 1, 0, None), "zero_bubble", loss_fn)
    timer = ActionTimer()
    rt.observers.append(timer)
    counts = {}
    orig_b, orig_w = rt._backward, rt._weight_grad

    def counted(kind, fn):
        def run(*a):
            with _Count() as c:
                fn(*a)
            counts[kind] = c.mm
            if kind == "B":
                assert all(q.grad is None for q in net.parameters()), "B must not touch weight grads"
        return run

    rt._backward, rt._weight_grad = counted("B", orig_b), counted("W", orig_w)
    rt.run(tokens, labels, m=1, denom=20.0)
    assert [e.kind for e in timer.events] == ["F", "B", "W"]
    for n, q in net.named_parameters():
        assert torch.allclose(q.grad, want[n], rtol=0, atol=1e-12), n
    assert counts["B"] < full.mm and counts["B"] + counts["W"] == full.mm
