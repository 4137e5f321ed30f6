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
    """Every schedule over the grid; DualPipeV (2 chunks per rank) where m >= 2p."""
    for name in SCHEDULES:
        for p in p_values:
            for m in m_values:
                if name == "dualpipev" and m < 2 * p:
                    continue
                for v in ((2, 3, 4) if name == "interleaved" else (2,) if name == "dualpipev" else (1,)):
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
    n_dualpipev = sum(1 for p in PS for m in MS if m >= 2 * p)
    assert n == 4 * len(PS) * len(MS) + 2 * len(PS) * len(MS) + n_dualpipev


def test_schedules_follow_their_warmup_formulas():
    """Each rank's order is warm-up forwards, then strict F/B alternation, then backwards, with the
    warm-up of the papers: 1F1B and ZB-H1 min(p-r-1, m) (PipeDream-Flush), interleaved
    min(v m, (p-r-1)*2 + (v-1)*g) chunk-forwards, g = p + m mod p (m < p: g = m) (Megatron-LM)."""
    for name, p, m, v in _all():
        if name in ("gpipe", "dualpipev"):  # dualpipev: test_dualpipev_phases
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
    Below m = p the latter two are never worse than 1F1B's bubble. DualPipeV (F = B = W per chunk,
    half a rank's): (p-1)/(6m+p-1) for every m >= 2p."""
    for _, p, m, v in _all(p_values=(2, 3, 4, 8)):
        if _ != name:
            continue
        s = build_schedule(name, p, m, v)
        tl = simulate(s, t_f=1.0 / v, t_w=1.0 / v)
        f = bubble_formula(name, p, m, v)
        if name in ("gpipe", "1f1b", "dualpipev") or m >= p:
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


def test_dualpipev_phases_placement_and_memory():
    """DualPipeV: rank r holds stages r and 2p-1-r (rank 0 the embedding and the head, rank p-1
    the turn of the V, handed over without a message); its order is the DualPipe repository's
    eight phases -- 2(p-r-1) chunk-0 forwards first, then r+1 pairs F0 F1 -- with m-2p+r+1 + ...
    overlapped pairs F(mb i, one chunk) + B(mb j != i, the other chunk); 2p+1 chunk-activations
    in flight on every rank (DeepSeek-V3 report, Table 2: PP + 1 with PP = 2p chunks)."""
    for p in (2, 3, 4, 8):
        for m in (2 * p, 2 * p + 1, 3 * p + 2):
            s = build_schedule("dualpipev", p, m)
            assert s.split_backward and s.vshape and s.v == 2
            for r in range(p):
                assert (s.stage(r, 0), s.stage(r, 1)) == (r, 2 * p - 1 - r)
                assert s.where(r) == (r, 0) and s.where(2 * p - 1 - r) == (r, 1)
                fb = [a for a in s.actions[r] if a.kind != "W"]
                lead = 2 * (p - r - 1)
                assert all(a.kind == "F" and a.chunk == 0 for a in fb[:lead]), (p, m, r)
                assert [(a.kind, a.chunk) for a in fb[lead:lead + 2]] == [("F", 0), ("F", 1)]
                for i in s.pairs[r]:
                    f, b = s.actions[r][i], s.actions[r][i + 1]
                    assert f.kind == "F" and b.kind == "B" and f.chunk != b.chunk, (p, m, r, i)
                # phase 4 runs m-2p+r+1 times with two pairs, phase 5 p-r-1 times with one
                assert len(s.pairs[r]) == 2 * (m - 2 * p + r + 1) + (p - r - 1), (p, m, r)
            assert s.message(p - 1, Action("F", 0, 0)) == ("F", 0, p)  # the V's turn: same rank
            assert p - 1 not in s.inbound(p - 1)
            assert peak_in_flight(s) == [2 * p + 1] * p
    with pytest.raises(ValueError, match=r"m \(3\) >= 2 \* pp \(4\)"):
        build_schedule("dualpipev", 2, 3)


def test_dualpipev_visualised():
    """The planned V timeline (text; PNGs are drawn by the same code as the other schedules')."""
    from ndtrain.parallel.pp.viz import planned_timeline, render_text

    text = render_text(planned_timeline("dualpipev", 4, 8, 2))
    assert "dualpipev p=4 m=8 v=2" in text and "formula   5.9%" in text and "idle   5.9%" in text  # 3/51
    rows = [ln.split("|")[1] for ln in text.splitlines() if ln.startswith("rank ") and "|" in ln]
    assert rows[0].startswith("F0F1F2F3F4F5F6f0b0w0") and rows[3].startswith("......F0f0F1f1")  # lower case: chunk 1


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
    ({"parallel.pp": "4", "model.n_layers": "1"}, 4, r"n_layers \(1\) < pp \* pp_virtual_stages \(4\) - 2"),
    ({"parallel.pp": "2", "parallel.pp_microbatches": "9", "training.global_batch_size": "8"}, 2,
     r"pp_microbatches \(9\) exceeds the local batch \(8"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "zero_bubble",
      "training.activation_checkpoint": "full"}, 2, r"zero_bubble needs activation_checkpoint=none"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "dualpipev", "model.n_layers": "4",
      "training.activation_checkpoint": "full"}, 2, r"dualpipev needs activation_checkpoint=none"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "dualpipev", "model.n_layers": "3"}, 2,
     r"n_layers \(3\) < 2 \* pp \(4\): pp_schedule=dualpipev holds 2 chunks per rank"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "dualpipev", "model.n_layers": "4",
      "training.global_batch_size": "6", "training.micro_batch_size": "2"}, 2,
     r"dualpipev needs >= 2 \* pp \(4\) microbatches per step \(got 3"),
])
def test_pp_config_rules(overrides, world, rule):
    with pytest.raises(ConfigError, match=rule):
        load_config("debug", overrides, world_size=world)


def test_pp_config_accepts_layouts():
    cfg = load_config("debug", {"parallel.pp": "2", "parallel.pp_schedule": "interleaved",
                                "parallel.pp_virtual_stages": "2", "model.n_layers": "4",
                                "parallel.pp_microbatches": "3"}, world_size=4)
    assert cfg.parallel.pp == 2
    for preset in ("deepseek_v3_debug", "moe_debug", "hybrid_debug"):  # MoE / MTP: every schedule
        for sched in SCHEDULES:
            over = {"parallel.pp": "2", "parallel.pp_schedule": sched, "model.n_layers": "4",
                    "training.micro_batch_size": "1"}
            if sched == "interleaved":
                over["parallel.pp_virtual_stages"] = "2"
            assert load_config(preset, over, world_size=2).parallel.pp_schedule == sched


def test_stage_costs_know_dense_from_moe_and_mtp():
    """A block costs 2 x its *active* parameters: an MoE block counts its top-k routed experts,
    not all E, so DeepSeek-V3's dense first layer weighs what it computes; MTP adds its block,
    projection and a second head matmul to the head's stage. The planner splits with the same
    costs (``tests/unit/test_planner_stages.py``)."""
    from ndtrain.model.moe import MoE
    from ndtrain.parallel.pp.stage import plan_stage

    cfg = load_config("deepseek_v3_debug", {"model.n_layers": "6", "model.moe_layer_start": "3"})
    _, blocks, head = layer_costs(cfg.model, cfg.data.seq_len)
    m = cfg.model
    with torch.device("meta"):
        routed = sum(q.numel() for q in MoE(m).experts.parameters())
    full = layer_costs(load_config("deepseek_v3_debug", {"model.n_layers": "6", "model.moe_layer_start": "3",
                                                         "model.mtp_depth": "0"}).model, cfg.data.seq_len)
    assert blocks == full[1]  # MTP changes no block
    dense, moe = blocks[0], blocks[3]
    assert abs((moe - dense) - (2 * routed * m.moe_top_k / m.moe_experts + 2 * m.dim * m.moe_experts
                                + 2 * 3 * m.dim * m.moe_ffn_hidden * m.moe_shared_experts
                                - 2 * 3 * m.dim * m.ffn_hidden)) < 1e-6, (moe, dense)
    assert head - full[2] > 2 * m.vocab_size * m.dim  # the MTP block and the second head matmul
    # the split follows: 3 dense + 3 MoE blocks and the MTP on the head's stage
    cfg.parallel.pp = 2
    assert [len(c) for r in range(2) for c in plan_stage(cfg, r).chunks] == [4, 2]


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
