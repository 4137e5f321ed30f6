"""ndtrain against PyTorch's own implementation of each axis, whole process against whole process.

    python bench/peers.py [--rounds 2] [--steps 12] [--rows single,ddp,...] [--quick] [--out FILE]

Each row runs, alternating (the order flips each round), a fresh set of processes of PyTorch's own
layout of an independent plain Llama (``bench/peers_plain.py``, ``bench/peers_layouts.py``) and a
fresh ``ndtrain train`` with the matching layout: dim 256, 8 layers, 8 heads, vocab 8192, 8
sequences x 256 tokens per data-parallel rank, bf16 autocast, AdamW, clipping at 1.0; the same
process count and threads per rank (``ndtrain.spawn.thread_policy``, which both sides follow).
Throughput is the median over steps 4..``steps`` of the wall time between consecutive step ends:
the plain side from its loop (batch creation included), ndtrain from ``metrics.jsonl`` row times
(``logging.log_every=1``: data loading, logging and the progress display included; ``step_time_s``,
``Trainer.step`` alone, is kept beside it). ndtrain reads the stdlib corpus byte-tokenised (same
compute: the 8192-wide head). Both sides' step-1 losses must lie within ``LOSS_TOL`` nats of each
other (both start near ln 8192 = 9.01): a row whose sides disagree is flagged ``loss_mismatch``.

Writes ``bench/results/<out>``: per row and round both sides' tokens/s and the ratio (ndtrain /
PyTorch; >= 1.0 means ndtrain is at least as fast), the machine's load (1/5/15 min) before each
round, and a row's error text where a side could not run (``context_parallel`` on CPU).
``--quick``: the one-process row, 3 steps, one round (a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOSS_TOL = 0.3  # nats: seeded inits differ, so only the range is compared, not the bits
FIRST_TIMED = 4  # steps 1-3 pay allocation and warm-up

# row: (processes, PyTorch layout, ndtrain overrides)
_PP = {"parallel.pp": 2, "parallel.pp_microbatches": 4}


def even_layout(n_stages: int, layers: int = 8) -> str:
    """``parallel.pp_layout`` of the split the PyTorch side uses (``peers_layouts.pp``): layers / n blocks
    per virtual stage, the embedding on the first, the head on the last; the same work per stage on
    both sides (ndtrain's default balance counts the embedding like the head and would differ)."""
    per = layers // n_stages
    return "|".join(("E" if i == 0 else "") + "t" * per + ("L" if i == n_stages - 1 else "")
                    for i in range(n_stages))


_PP1, _PP2 = _PP | {"parallel.pp_layout": even_layout(2)}, _PP | {"parallel.pp_layout": even_layout(4)}
ROWS = {
    "single": (1, "plain", {}),
    "ddp": (2, "ddp", {}),
    "fsdp2": (2, "fsdp2", {"parallel.zero_stage": 3}),
    "tp": (2, "tp", {"parallel.tp": 2}),
    "tp_sp": (2, "tp_sp", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "gpipe": (2, "pp:gpipe", _PP1 | {"parallel.pp_schedule": "gpipe"}),
    "1f1b": (2, "pp:1f1b", _PP1 | {"parallel.pp_schedule": "1f1b"}),
    "interleaved": (2, "pp:interleaved", _PP2 | {"parallel.pp_schedule": "interleaved",
                                                 "parallel.pp_virtual_stages": 2}),
    "zero_bubble": (2, "pp:zero_bubble", _PP1 | {"parallel.pp_schedule": "zero_bubble"}),
    "zbv": (2, "pp:zbv", _PP2 | {"parallel.pp_schedule": "dualpipev"}),
    "dualpipev": (2, "pp:dualpipev", _PP2 | {"parallel.pp_schedule": "dualpipev"}),
    "cp": (2, "cp", {"parallel.cp": 2}),
}


def ndtrain_overrides(nproc: int, extra: dict, steps: int, cache: Path) -> list[str]:
    from bench.peers_plain import B, DIM, FFN, HEADS, LAYERS, T, VOCAB

    dp = nproc if not any(k in extra for k in ("parallel.tp", "parallel.pp", "parallel.cp")) else 1
    over = {"model.dim": DIM, "model.n_layers": LAYERS, "model.n_heads": HEADS, "model.n_kv_heads": 0,
            "model.vocab_size": VOCAB, "model.ffn_hidden": FFN, "model.tie_embeddings": False,
            "model.rope_theta": 500000.0, "model.max_seq_len": T, "data.seq_len": T,
            "data.tokenizer": "bytes", "data.max_corpus_bytes": 3_000_000, "data.cache_dir": str(cache),
            "training.global_batch_size": B * dp, "training.micro_batch_size": 0,
            "training.dtype": "bfloat16", "training.device": "cpu", "training.activation_checkpoint": "none",
            "training.grad_clip": 1.0, "training.steps": 1000, "training.stop_at_step": steps,
            "training.eval_every": 0, "training.eval_batches": 1, "checkpoint.every": 0,
            "logging.log_every": 1, "logging.plot": False, "logging.progress": "plain", **extra}
    return [f"--{k}={v}" for k, v in over.items()]


def run_ndtrain(nproc: int, extra: dict, steps: int, cache: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        cmd = [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "default", "--nproc",
               str(nproc), "--run-dir", str(Path(tmp) / "run"), *ndtrain_overrides(nproc, extra, steps, cache)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                             env=dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1"))
        if out.returncode != 0:
            return {"error": (out.stderr.strip() or out.stdout.strip()).splitlines()[-1]}
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = {r["step"]: r for r in rows if r.get("step", 0) >= 1 and "tokens_per_s" in r}
    times = [rows[s]["time"] - rows[s - 1]["time"] for s in range(FIRST_TIMED, steps + 1)]
    threads = next((ln for ln in out.stdout.splitlines() if ln.startswith("threads:")), "")
    inner = [rows[s]["step_time_s"] for s in range(FIRST_TIMED, steps + 1)]
    return {"step1_loss": rows[1]["loss"], "loop_step_s": statistics.median(times),
            "step_s": statistics.median(inner),  # Trainer.step alone
            # what the loop adds per step around Trainer.step (data, logging, progress, guards)
            "loop_overhead_s": statistics.median(a - b for a, b in zip(times, inner, strict=True)),
            "threads": threads}


def run_torch(nproc: int, layout: str, steps: int) -> dict:
    from bench.peers_plain import worker
    from ndtrain.spawn import SpawnError, policy_env, spawn, thread_policy

    p = thread_policy(nproc)
    try:
        res = spawn(worker, nproc, (layout, steps), backend="gloo", threads=p.threads, env=policy_env(p),
                    timeout_s=3600.0)
    except SpawnError as e:
        return {"error": str(e)}
    # every rank's loop: the step ends when the slowest rank's does (the median of their medians)
    loss = next(r["step1_loss"] for r in res if r["step1_loss"] is not None)
    per_rank = [statistics.median(r["step_s"][FIRST_TIMED - 1:]) for r in res]
    return {"step1_loss": loss, "loop_step_s": max(per_rank), "threads": f"{res[0]['threads']} per rank"}


def run_row(name: str, steps: int, cache: Path, flip: bool) -> dict:
    from bench.peers_plain import B, T

    nproc, layout, extra = ROWS[name]
    sides, load = {}, os.getloadavg()
    for side in (("ndtrain", "torch") if flip else ("torch", "ndtrain")):
        sides[side] = (run_ndtrain(nproc, extra, steps, cache) if side == "ndtrain"
                       else run_torch(nproc, layout, steps))
    row = {"row": name, "processes": nproc, "torch_layout": layout, "ndtrain": sides["ndtrain"],
           "torch": sides["torch"], "ratio": None, "load_before": load, "load_after": os.getloadavg()}
    if "error" in sides["ndtrain"] or "error" in sides["torch"]:
        return row
    dp = nproc if layout in ("ddp", "fsdp2") else 1
    for side in ("ndtrain", "torch"):
        sides[side]["tokens_per_s"] = dp * B * T / sides[side]["loop_step_s"]
    row["ratio"] = sides["ndtrain"]["tokens_per_s"] / sides["torch"]["tokens_per_s"]
    row["loss_mismatch"] = abs(sides["ndtrain"]["step1_loss"] - sides["torch"]["step1_loss"]) > LOSS_TOL
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--quick", action="store_true", help="the one-process row, 3 steps, one round")
    ap.add_argument("--out", default="", help="file name under bench/results/ (or a path); default "
                    "peers.json, peers_quick.json with --quick (the measured table is never overwritten by a smoke test)")
    args = ap.parse_args(argv)
    rows, steps, rounds = args.rows.split(","), args.steps, args.rounds
    if args.quick:
        rows, steps, rounds = ["single"], 3, 1
    args.out = args.out or ("peers_quick.json" if args.quick else "peers.json")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    global FIRST_TIMED
    FIRST_TIMED = min(FIRST_TIMED, steps)
    cache = Path(os.environ.get("NDTRAIN_PEERS_CACHE", Path(tempfile.gettempdir()) / "ndtrain-peers-cache"))
    from ndtrain.tools.bench_utils import write_result

    res = {"model": "dim 256, 8 layers, 8 heads, vocab 8192, ffn 768, 256 tokens, 8 sequences per dp rank, "
                    "bf16 autocast, AdamW", "steps": steps, "timed_steps": f"{FIRST_TIMED}..{steps}",
           "rounds": []}
    for k in range(rounds):
        rnd = {"load_before": os.getloadavg(), "rows": []}
        for name in rows:
            row = run_row(name, steps, cache, flip=(k % 2 == 1))
            rnd["rows"].append(row)
            print(json.dumps(row), flush=True)
        rnd["load_after"] = os.getloadavg()
        res["rounds"].append(rnd)
    path = write_result(ROOT / "bench" / "results" / args.out, res, "cpu")
    print(path)
    return res


if __name__ == "__main__":
    main()
