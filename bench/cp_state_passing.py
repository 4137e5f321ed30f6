"""Context parallel of the linear-family sequence ops: state passing (ours) against Ulysses.

    python bench/cp_state_passing.py             # cp = 2 and 4, T = 1024 / 4096 / 8192 (gloo, CPU)
    python bench/cp_state_passing.py --lengths 4096 16384 --repeats 5
    python bench/cp_state_passing.py --quick     # T = 512 / 2048, 2 repeats

For each mixer's sequence op (linear attention: no decay, elu+1 features; Mamba-2 / SSD: scalar
per-token decay; Gated DeltaNet: decay + delta rule with L2-normalised q / k) on B = 1, H = 4 heads,
K = V = 32, chunk 64, float32, each rank holding a contiguous T / cp of the sequence:

* ``state_passing``: ``ndtrain.parallel.cp.state_passing.StatePasser.scan`` (the chunked op from
  zero on the local tokens, an all-gather of every rank's packed state, a local prefix composition,
  a correction of the outputs);
* ``ulysses``: ``ndtrain.parallel.cp.ulysses_mixer.ulysses_scan`` (all-to-all q / k / v / gates to
  H / cp heads x the whole sequence, the chunked op, all-to-all of the output back).

Measured per (mixer, cp, T): the bytes one rank sends on cp for one forward + backward (counted by
``ndtrain.parallel.comm``, asserted equal to the closed forms in ``ulysses_mixer``), and the median
and minimum over repeats of the wall time of forward + backward (a barrier before and after each
call, so the slowest rank sets the time; the two forms alternate call by call, so the machine's
load hits both alike; on a loaded machine the minimum is the steadier figure). Before timing, both forms are checked against the single-process
op on the whole sequence, outputs and every input gradient: float64 at T = 96 to 1e-10 relative
(exact algebra), float32 at the timed sizes to 1e-3 relative (summation order only). The
single-process time of the whole sequence (one thread) is reported alongside.

Each rank runs one thread; with cp ranks on a shared machine the times carry the machine's load
(``machine.load_avg_1_5_15`` in the JSON). Writes ``bench/results/cp_state_passing.json`` and
``docs/images/cp_state_passing.png``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.mesh import ParallelDims
from ndtrain.ops.gated_delta.chunk import chunk_gated_delta
from ndtrain.ops.linear_attn.chunk import chunk_linear_attn
from ndtrain.parallel.cp.state_passing import StatePasser
from ndtrain.parallel.cp.ulysses_mixer import state_passing_bytes, ulysses_bytes, ulysses_scan
from ndtrain.spawn import spawn
from ndtrain.tools.bench_utils import time_fn, write_result

B, H, DK, DV, CHUNK = 1, 4, 32, 32, 64
KINDS = ("linear", "mamba2", "gated_deltanet")
N_GATES = {"linear": 0, "mamba2": 1, "gated_deltanet": 2}


def make_inputs(kind: str, t: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """The op inputs of ``kind`` for a whole sequence: q, k (B, H, T, K), v (B, H, T, V), then the
    gates (B, H, T): Mamba-2 a log decay, Gated DeltaNet a log decay and beta. Same on every rank."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, t, d, generator=g, dtype=torch.float64) for d in (DK, DK, DV))
    gates = []
    if kind == "linear":
        q, k = F.elu(q) + 1, F.elu(k) + 1  # the mixer's positive feature map
    else:
        gates.append(-0.1 * torch.rand(B, H, t, generator=g, dtype=torch.float64) - 0.01)  # log decay < 0
    if kind == "gated_deltanet":
        q, k = F.normalize(q, dim=-1) * DK ** -0.5, F.normalize(k, dim=-1)
        gates.append(torch.rand(B, H, t, generator=g, dtype=torch.float64).sigmoid())  # beta in (0, 1)
    return [x.to(dtype) for x in (q, k, v, *gates)]


def op_of(kind: str):
    """``op(q, k, v, *gates, state) -> (o, state)``, the whole-sequence chunked op of ``kind``."""
    if kind == "linear":
        return lambda q, k, v, s: chunk_linear_attn(q, k, v, None, s, CHUNK)
    if kind == "mamba2":
        return lambda q, k, v, g, s: chunk_linear_attn(q, k, v, g, s, CHUNK)
    return lambda q, k, v, g, b, s: chunk_gated_delta(q, k, v, g, b, s, CHUNK)


def state_passing_fn(kind: str, group):
    """``fn(q, k, v, *gates) -> o`` on the local tokens through ``StatePasser.scan``."""
    passer, op = StatePasser(group), op_of(kind)

    def fn(q, k, v, *gates):
        def run(q_, k_, v_, s_):  # the local sequence op from state s_ (the gates are per-token, local)
            return op(q_, k_, v_, *gates, s_)
        log_decay = gates[0] if gates else None
        return passer.scan(run, q, k, v, log_decay, delta=kind == "gated_deltanet")[0]
    return fn


def ulysses_fn(kind: str, group):
    op = op_of(kind)
    return lambda q, k, v, *gates: ulysses_scan(op, group, q, k, v, *gates)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def check(kind: str, t: int, dtype: torch.dtype, group, fns: dict) -> dict[str, float]:
    """Worst relative error of each form's output and input gradients against the whole sequence."""
    full = [x.requires_grad_() for x in make_inputs(kind, t, dtype)]
    gout = torch.randn(B, H, t, DV, generator=torch.Generator().manual_seed(7), dtype=dtype)
    o_ref = op_of(kind)(*full, None)[0]
    grads = torch.autograd.grad((o_ref * gout).sum(), full)
    n, r = group.size, group.rank
    sl = slice(r * t // n, (r + 1) * t // n)
    out = {}
    for name, fn in fns.items():
        local = [x.detach()[:, :, sl].clone().requires_grad_() for x in full]
        o = fn(*local)
        g_local = torch.autograd.grad((o * gout[:, :, sl]).sum(), local)
        errs = [_rel(o, o_ref[:, :, sl])] + [_rel(a, b[:, :, sl]) for a, b in zip(g_local, grads)]
        out[name] = max(errs)
    return out


def measure(kind: str, t: int, group, mesh, repeats: int) -> dict:
    """Bytes (counted and closed form) and fwd + bwd time of both forms for ``kind`` at length t."""
    fns = {"state_passing": state_passing_fn(kind, group), "ulysses": ulysses_fn(kind, group)}
    row = {"kind": kind, "cp": group.size, "T": t,
           "err_fp64": check(kind, 96, torch.float64, group, fns),
           "err_fp32": check(kind, t, torch.float32, group, fns)}
    n, r = group.size, group.rank
    local = [x[:, :, r * t // n:(r + 1) * t // n].clone().requires_grad_() for x in make_inputs(kind, t, torch.float32)]
    gout = torch.randn(B, H, t // n, DV)
    theory = {"state_passing": 2 * state_passing_bytes(B, H, DK, DV, n, 4, kind == "gated_deltanet"),
              "ulysses": 2 * ulysses_bytes(B, t, H, DK, DV, N_GATES[kind], n, 4)}
    def step(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        torch.autograd.grad((fn(*local) * gout).sum(), local)
        dist.barrier()  # the slowest rank sets the time
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():  # one untimed call each (warm-up) counts the bytes
        mesh.reset_stats()
        step(fn)
        sent = mesh.reset_stats().get("cp", 0.0)
        assert sent == theory[name], (kind, name, sent, theory[name])
        row[name] = {"bytes_fwd_bwd": sent, "bytes_theory": theory[name]}
    for _ in range(repeats):  # the forms alternate, so the machine's load hits both alike
        for name, fn in fns.items():
            times[name].append(step(fn))
    for name, ts in times.items():
        row[name].update(median_s=statistics.median(ts), min_s=min(ts), times_s=ts)
    return row


def _rank(rank: int, world: int, lengths: list[int], repeats: int) -> list[dict]:
    mesh = ParallelDims(cp=world, world_size=world).build_mesh()
    group = mesh.group("cp")
    rows = []
    for kind in KINDS:
        for t in lengths:
            row = measure(kind, t, group, mesh, repeats)
            for name in ("err_fp64", "err_fp32"):  # the worst over ranks
                errs = torch.tensor([row[name][k] for k in sorted(row[name])], dtype=torch.float64)
                dist.all_reduce(errs, op=dist.ReduceOp.MAX)
                row[name] = dict(zip(sorted(row[name]), errs.tolist()))
            rows.append(row)
    return rows


def single_process(kind: str, t: int, repeats: int) -> dict:
    """Median and minimum fwd + bwd seconds of the whole-sequence op in this process (one thread)."""
    x = [a.requires_grad_() for a in make_inputs(kind, t, torch.float32)]
    gout = torch.randn(B, H, t, DV)
    op = op_of(kind)
    tm = time_fn(lambda: torch.autograd.grad((op(*x, None)[0] * gout).sum(), x), "cpu", 1, repeats)
    return {"median_s": tm.median_s, "min_s": tm.min_s}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"linear": "tab:blue", "mamba2": "tab:orange", "gated_deltanet": "tab:green"}
    for kind in KINDS:
        for cp, ls in ((2, "-"), (4, "--")):
            rs = [r for r in rows if r["kind"] == kind and r["cp"] == cp]
            ts = [r["T"] for r in rs]
            for name, mk in (("state_passing", "o"), ("ulysses", "s")):
                lab = f"{kind} cp{cp} {'SP' if name == 'state_passing' else 'Ulysses'}"
                axes[0].plot(ts, [r[name]["bytes_fwd_bwd"] / 1e6 for r in rs], ls, marker=mk, color=colors[kind],
                             alpha=1.0 if name == "state_passing" else 0.5, label=lab)
                axes[1].plot(ts, [r[name]["min_s"] * 1e3 for r in rs], ls, marker=mk, color=colors[kind],
                             alpha=1.0 if name == "state_passing" else 0.5)
    for ax, title, unit in ((axes[0], "bytes sent per rank, fwd+bwd", "MB"),
                            (axes[1], "fwd+bwd time (min of repeats, CPU gloo, loaded)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (whole sequence)")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle("CP for linear mixers: state passing (o) vs Ulysses all-to-all (s); B=1 H=4 K=V=32 fp32")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lengths, repeats = ([512, 2048], 2) if args.quick else (args.lengths, args.repeats)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    for cp in (2, 4):
        rows += spawn(_rank, cp, (lengths, repeats), backend="gloo", threads=1, timeout_s=1800)[0]
    single = {f"{k}/{t}": single_process(k, t, repeats) for k in KINDS for t in lengths}
    for r in rows:
        sp, ul, one = r["state_passing"], r["ulysses"], single[f"{r['kind']}/{r['T']}"]
        assert max(r["err_fp64"].values()) < 1e-10, r
        assert max(r["err_fp32"].values()) < 1e-3, r
        print(f"{r['kind']:>15} cp{r['cp']} T={r['T']:>6}: bytes SP {sp['bytes_fwd_bwd'] / 1e3:9.1f} kB, "
              f"Ulysses {ul['bytes_fwd_bwd'] / 1e3:9.1f} kB | time (min) SP {sp['min_s'] * 1e3:8.1f} ms, "
              f"Ulysses {ul['min_s'] * 1e3:8.1f} ms, single {one['min_s'] * 1e3:8.1f} ms | "
              f"err fp64 {max(r['err_fp64'].values()):.1e} fp32 {max(r['err_fp32'].values()):.1e}")
    out = write_result(ROOT / "bench" / "results" / "cp_state_passing.json",
                       {"B": B, "H": H, "K": DK, "V": DV, "chunk": CHUNK, "dtype": "float32", "lengths": lengths,
                        "repeats": repeats, "rows": rows, "single_process_s": single,
                        "wall_s": time.perf_counter() - t0}, "cpu")
    plot(rows, ROOT / "docs" / "images" / "cp_state_passing.png")
    print(f"wrote {out} and docs/images/cp_state_passing.png")


if __name__ == "__main__":
    main()
