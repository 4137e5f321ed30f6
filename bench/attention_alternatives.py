"""Token mixers against softmax attention: tokens/s and activation memory vs sequence length.

    python bench/attention_alternatives.py [--lengths 256,512,...,16384] [--dim 128] [--heads 4]
                                           [--out JSON] [--png PNG] [--memory-cap-bytes 2e9]

One mixer layer (``ndtrain.model.mixers.build_mixer``: the module a decoder block holds) per kind
-- softmax ``attention`` (SDPA, causal), ``linear`` (elu+1 feature map, chunked), ``mamba2`` (SSD,
chunked), ``gated_deltanet`` (chunked WY form), ``sliding_window`` (window 256, blocked), ``dsa``
(indexer + top-256 keys) -- built from one scaled-down ``ModelConfig`` (dim 128, 4 heads of 32, 2
kv heads, chunk 64, fp32, batch 1), runs forward + backward of ``sum(out * g)`` for each length T:

* tokens/s = T / median seconds of forward + backward (``ndtrain.tools.bench_utils.time_fn``; one
  warm-up per mixer at the shortest length, then one warm-up and ``--repeats`` per length), by the
  wall clock and on-core (process CPU time: on a shared machine a long call is descheduled part of
  its wall time; the figure and ``crossover_T_on_core`` use the on-core rate);
* activation memory = peak bytes of live storages the forward + backward create
  (``bench_utils.peak_bytes``: ``ndtrain.mem_account.ActivationMeter``; inputs, parameters and the
  parameter gradients excluded, input gradients included).

The crossover length of a mixer is the first measured T from which it beats softmax attention on
tokens/s at every longer measured T (None if it never does). A length whose activations,
extrapolated quadratically from the mixer's previous length, would pass ``--memory-cap-bytes`` is
skipped and marked so (DSA: its indexer scores and top-k gathers grow with T^2 and T k; 0.66 GiB
at T = 1024 here). Writes ``bench/results/attention_alternatives.json`` and
``docs/images/mixers_vs_length.png``. CPU, one process; the machine's load is in the JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config.schema import ModelConfig
from ndtrain.tools import bench_utils

KINDS = ("attention", "linear", "mamba2", "gated_deltanet", "sliding_window", "dsa")
LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def model_config(dim: int, heads: int, max_len: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        dim=dim,
        n_layers=1,
        n_heads=heads,
        n_kv_heads=max(1, heads // 2),
        max_seq_len=max_len,
        linear_chunk_size=64,
        swa_window=256,
        dsa_top_k=256,
        dsa_index_heads=4,
    )


def measure(kind: str, cfg: ModelConfig, lengths, repeats: int, cap: float) -> list[dict]:
    """Rows {T, tokens_per_s, median_s, act_peak_bytes} (or {T, skipped}) for one mixer kind."""
    from ndtrain.model.mixers import build_mixer
    from ndtrain.model.rope import rope_tables

    torch.manual_seed(0)
    layer = build_mixer(cfg, "0", kind)
    if hasattr(layer, "init_weights"):
        layer.init_weights(cfg.init_std)
    cos_all, sin_all = rope_tables(cfg)
    rows = []

    def step_fn(t: int):
        x = torch.randn(1, t, cfg.dim, requires_grad=True)
        g = torch.randn(1, t, cfg.dim)
        cos, sin = cos_all[:t], sin_all[:t]

        def run():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            (layer(x, cos, sin) * g).sum().backward()

        return run

    step_fn(lengths[0])()  # first call: allocator, thread pool and dispatch warm-up
    for t in lengths:
        prev = next((r for r in reversed(rows) if "act_peak_bytes" in r), None)
        if prev and prev["act_peak_bytes"] * (t / prev["T"]) ** 2 > cap:  # worst case: quadratic growth
            rows.append(
                {
                    "T": t,
                    "skipped": f"activations extrapolated quadratically from T={prev['T']} pass {cap:.0e} B",
                }
            )
            continue
        run = step_fn(t)
        tm = bench_utils.time_fn(run, "cpu", warmup=1, repeats=repeats)
        rows.append(
            {
                "T": t,
                "median_s": tm.median_s,
                "tokens_per_s": t / tm.median_s,
                "tokens_per_s_on_core": t / tm.cpu_median_s,
                "act_peak_bytes": bench_utils.peak_bytes(run, "cpu"),
            }
        )
        print(
            f"{kind:15s} T={t:6d}: {rows[-1]['tokens_per_s']:10,.0f} tok/s  "
            f"act {rows[-1]['act_peak_bytes'] / 2**20:8.1f} MiB",
            flush=True,
        )
    return rows


def crossover(base: list[dict], rows: list[dict], key: str = "tokens_per_s") -> int | None:
    """First T from which ``rows`` beats ``base`` on ``key`` at every longer T measured by both."""
    b = {r["T"]: r[key] for r in base if key in r}
    both = [(r["T"], r[key] > b[r["T"]]) for r in rows if key in r and r["T"] in b]
    best = None
    for t, wins in reversed(both):
        if not wins:
            break
        best = t
    return best


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (kind, rows) in enumerate(result["mixers"].items()):
        ok = [r for r in rows if "tokens_per_s" in r]
        ts = [r["T"] for r in ok]
        cross = result["crossover_T_on_core"].get(kind)
        label = kind + (f" (wins from T={cross})" if cross and kind != "attention" else "")
        ax1.plot(ts, [r["tokens_per_s_on_core"] for r in ok], "o-", color=f"C{i}", label=label)
        ax1.plot(ts, [r["tokens_per_s"] for r in ok], ":", color=f"C{i}", alpha=0.4)  # wall clock
        ax2.plot(ts, [r["act_peak_bytes"] / 2**20 for r in ok], "o-", color=f"C{i}", label=kind)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (batch 1)")
    ax1.set_ylabel("tokens/s, fwd + bwd (solid: on-core CPU time; dotted: wall)")
    ax2.set_ylabel("activation memory, peak (MiB)")
    ax1.legend(fontsize=7)
    m, c = result["machine"], result["config"]
    fig.suptitle(
        f"one mixer layer, dim {c['dim']}, {c['n_heads']} heads, fp32; {m['device_name']}, "
        f"{m['cpu_count']} CPUs, load {m['load_avg_1_5_15'][0]}",
        fontsize=9,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def summarize(cfg: ModelConfig, mixers: dict[str, list[dict]]) -> dict:
    """The JSON body: config, every mixer's rows, crossover lengths against attention."""
    base = mixers.get("attention", [])
    return {
        "config": {
            "dim": cfg.dim,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "linear_chunk_size": cfg.linear_chunk_size,
            "swa_window": cfg.swa_window,
            "dsa_top_k": cfg.dsa_top_k,
            "batch": 1,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
        },
        "mixers": mixers,
        "crossover_T": {k: crossover(base, v) for k, v in mixers.items() if k != "attention"},
        "crossover_T_on_core": {
            k: crossover(base, v, "tokens_per_s_on_core") for k, v in mixers.items() if k != "attention"
        },
        "cp_state_passing": "cp=2/4 state passing vs Ulysses bytes / time: bench/cp_state_passing.py",
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--memory-cap-bytes", type=float, default=2e9)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention_alternatives.json"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "images" / "mixers_vs_length.png"))
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = model_config(a.dim, a.heads, max(lengths))
    mixers: dict[str, list[dict]] = {}
    for kind in a.kinds.split(","):  # the JSON is rewritten after each mixer: a killed run keeps its rows
        mixers[kind] = measure(kind, cfg, lengths, a.repeats, a.memory_cap_bytes)
        result = summarize(cfg, mixers)
        bench_utils.write_result(a.out, result, "cpu")
    result["machine"] = bench_utils.machine_info("cpu")
    plot(result, Path(a.png))
    print("crossover T:", result["crossover_T"], f"-> {a.out}")
    return result


if __name__ == "__main__":
    main()
