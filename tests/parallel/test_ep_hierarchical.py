"""Hierarchical MoE dispatch and node-limited routing against the single process, and its bytes per hop.

One spawned group of 4 gloo ranks = two 2-rank "nodes" (``parallel.node_size`` 2), ``deepseek_v3_debug``
shrunk (E 16, k 4, 4 groups / top-2, sigmoid, shared expert, MTP), float64, dp_shard 4 x ep 4.
Reference: a one-process ``Trainer`` on the whole global batch whose routers are given the layout's
two node blocks (``set_route_nodes``), so node-limited routing (``moe_max_nodes`` 1) picks the same
experts. Checked: 10 steps of hierarchical dispatch within 1e-8 of the reference (loss, grad norm,
final parameters: only sums are reordered, ~1e-14 in float64; a misrouted row or a dropped weight is
O(1)); the flat dispatch on the same routing as well. Bytes: every rank's experts-side calls are
recorded (counts and token ids per row), and the counters summed over the 4 ranks must equal the
formula exactly: ``ep_inter`` = 4 x (token, remote node) pairs x C b (dispatch, combine, and their
backward), ``ep_intra`` = 4 x assignments whose expert is not on the sender's local index x C b; flat's
``ep`` = 4 x off-rank assignments x C b + the count exchange + the grad norm's scalar (flat: 3 steps). With M = 1 each token touches one node
and sends k rows there under flat dispatch, so hierarchical cross-node bytes are flat's divided by k
exactly; without the limit (2 steps) the pairs stay <= nodes touched - 1 per token."""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import validate
from ndtrain.errors import ConfigError
from ndtrain.mesh import ParallelDims
from ndtrain.model.moe import moe_layers, set_route_nodes
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.utils import rel_err, tiny_config

G, T, STEPS, WORLD, NODE, E, K = 4, 16, 10, 4, 2, 16, 4
FLAT_STEPS = 3  # the flat run is the byte baseline (its parity over 10 steps is test_ep's)
NORM_BYTES = WORLD * 2 * (WORLD - 1) / WORLD * 8  # the grad norm's float64 all-reduce over ep, all ranks


def make_cfg(world: int, dispatch: str = "flat", max_nodes: int = 1, parallel: dict | None = None):
    par = {"dp_shard": world, "ep": world, "node_size": NODE, "moe_dispatch": dispatch} if world > 1 else {}
    return tiny_config({"training.global_batch_size": G, "data.seq_len": T, "model.moe_max_nodes": max_nodes},
                       world=world, preset="deepseek_v3_debug", parallel={**par, **(parallel or {})})


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randint(0, 61, (G, T), generator=g), torch.randint(0, 61, (G, T), generator=g)


def _record_calls(tr: Trainer, calls: list) -> None:
    """Wrap every MoE layer's experts to record (counts, tokens or None) of each training call."""
    for moe in moe_layers(tr.model):
        ex = moe.experts
        fwd = ex.forward

        def wrapped(xs, counts, *rest, _fwd=fwd, _ex=ex, **kw):
            if _ex.training and torch.is_grad_enabled():
                calls.append((counts.clone(), rest[1].clone() if len(rest) > 1 else None))
            return _fwd(xs, counts, *rest, **kw)

        ex.forward = wrapped


def train(tr: Trainer, steps: int) -> dict:
    mesh, calls = tr.mesh, []
    _record_calls(tr, calls)
    dp, rank = mesh.dims.dp, mesh.group("dp").rank
    local = G // dp
    out = {"loss": [], "gn": [], "bytes": [], "calls": []}
    for step in range(steps):
        x, y = batch(step)
        mesh.reset_stats()
        calls.clear()
        d = tr.step(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
        out["bytes"].append(mesh.reset_stats())
        out["calls"].append(list(calls))
        out["loss"].append(d["loss"])
        out["gn"].append(d["grad_norm"])
    out["params"] = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    out["ep_rank"] = mesh.group("ep").rank
    return out


def _ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = Trainer(make_cfg(1), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    set_route_nodes(ref.model, world // NODE)
    res = {"ref": train(ref, STEPS) if rank == 0 else None}
    for name, dispatch, max_nodes, steps in (("hier", "hierarchical", 1, STEPS), ("flat", "flat", 1, FLAT_STEPS),
                                             ("hier_free", "hierarchical", 0, 2)):
        cfg = make_cfg(world, dispatch, max_nodes)
        torch.manual_seed(0)
        tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
        res[name] = train(tr, steps)
        if name == "hier" and rank == 0:
            res["repr"] = repr(moe_layers(tr.model)[0].experts)
    return res


def predicted(calls: list, ep_rank: int, flat: bool) -> dict[str, float]:
    """Rows of one rank's training calls of one step, by hop (module docstring): pairs / intra for
    hierarchical, off-rank / cross-node assignments for flat, and the tokens' nodes touched."""
    el, per, g = E // WORLD, E // (WORLD // NODE), NODE
    my_node, my_local = ep_rank // g, ep_rank % g
    out = dict.fromkeys(("pairs", "intra", "off_rank", "remote", "touched", "calls"), 0)
    for counts, tokens in calls:
        expert = torch.arange(E).repeat_interleave(counts)
        owner, node = expert // el, expert // per
        out["calls"] += 1
        out["off_rank"] += int((owner != ep_rank).sum())
        out["remote"] += int((node != my_node).sum())
        out["intra"] += int((owner % g != my_local).sum())
        if not flat:
            pairs = torch.unique(node * 10_000 + tokens)
            out["pairs"] += int((pairs // 10_000 != my_node).sum())
            out["touched"] += int(pairs.numel())
    return out


def test_hierarchical_dispatch_matches_one_process_and_its_byte_formula():
    res = run_ranks(_ranks, WORLD, timeout_s=900)
    ref = res[0]["ref"]
    row = 32 * 8  # C x float64
    for name, steps in (("hier", STEPS), ("flat", FLAT_STEPS)):
        for r in res:
            o = r[name]
            for step in range(steps):
                assert rel_err(o["loss"][step], ref["loss"][step]) < 1e-8, (name, step)
                assert rel_err(o["gn"][step], ref["gn"][step]) < 1e-8, (name, step)
            el = E // WORLD
            for n, p in (o["params"] if name == "hier" else {}).items():  # the reference ends at step 10
                q = ref["params"][n]
                if ".experts." in n:
                    q = q[o["ep_rank"] * el:(o["ep_rank"] + 1) * el]
                assert rel_err(p, q) < 1e-8, (name, n)
    assert "hierarchical (2 nodes x 2 ranks)" in res[0]["repr"]
    for step in range(FLAT_STEPS):
        hier = [predicted(r["hier"]["calls"][step], r["hier"]["ep_rank"], False) for r in res]
        flat = [predicted(r["flat"]["calls"][step], r["flat"]["ep_rank"], True) for r in res]
        measured = {ax: sum(r["hier"]["bytes"][step].get(ax, 0.0) for r in res) for ax in ("ep_inter", "ep_intra")}
        pairs, intra = sum(h["pairs"] for h in hier), sum(h["intra"] for h in hier)
        assert measured["ep_inter"] == 4 * pairs * row, step
        assert measured["ep_intra"] == 4 * intra * row, step
        flat_ep = sum(r["flat"]["bytes"][step]["ep"] for r in res)
        counts_bytes = sum(f["calls"] for f in flat) * (WORLD - 1) * (E // WORLD) * 8
        assert flat_ep == 4 * sum(f["off_rank"] for f in flat) * row + counts_bytes + NORM_BYTES, step
        remote = sum(f["remote"] for f in flat)
        assert remote > 0 and remote == K * pairs, step  # M = 1: k rows per token to its one node
        assert measured["ep_inter"] * K == 4 * remote * row, step  # below flat's cross-node bytes by k
        assert sum(r["hier"]["bytes"][step]["ep"] for r in res) == NORM_BYTES  # nothing went the flat way
    for step in range(2):
        free = [predicted(r["hier_free"]["calls"][step], r["hier_free"]["ep_rank"], False) for r in res]
        inter = sum(r["hier_free"]["bytes"][step]["ep_inter"] for r in res)
        pairs = sum(f["pairs"] for f in free)
        assert inter == 4 * pairs * row
        assert pairs <= sum(f["touched"] for f in free)  # at most one copy per node touched
        assert 0 < pairs < sum(f["remote"] for f in free)  # de-duplicated: flat sends every remote assignment


@pytest.mark.parametrize("par,model,rule", [
    ({"moe_dispatch": "ring"}, {}, "moe_dispatch \\(ring\\) must be flat|hierarchical"),
    ({"ep": 1, "moe_dispatch": "hierarchical"}, {}, "needs ep > 1"),
    ({"node_size": 3, "moe_dispatch": "hierarchical"}, {}, "node_size \\(3\\) must divide ep \\(4\\)"),
    ({"moe_dispatch": "hierarchical", "moe_shared_overlap": True}, {}, "excludes parallel.moe_shared_overlap"),
    ({}, {"moe_max_nodes": 3}, "moe_max_nodes \\(3\\) exceeds the nodes an ep group spans \\(2\\)"),
    ({}, {"moe_max_nodes": 1, "moe_topk_groups": 3}, "moe_topk_groups \\(3\\) exceeds the groups on moe_max_nodes"),
    ({}, {"moe_max_nodes": 1, "moe_n_groups": 1, "moe_topk_groups": 1, "moe_top_k": 9},
     "moe_top_k \\(9\\) exceeds the experts on moe_max_nodes"),
])
def test_rules_name_what_failed(par, model, rule):
    cfg = make_cfg(WORLD, max_nodes=0)
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    with pytest.raises(ConfigError, match=rule):
        validate(cfg, WORLD)


def test_node_size_defaults_to_the_launch(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's ranks per node
    with pytest.raises(ConfigError, match="node_size \\(3\\) must divide ep"):
        make_cfg(WORLD, "hierarchical", 0, {"node_size": 0})
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    make_cfg(WORLD, "hierarchical", 0, {"node_size": 0})  # one launch of 4: one node holds the ep group
