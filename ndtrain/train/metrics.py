"""FLOPs per token, MFU / HFU, peak memory, and the metrics log (console line + JSONL + plot).

Every ``metrics.jsonl`` row carries ``step`` and ``time`` (Unix seconds when it was logged).

MFU convention (PaLM, Chowdhery et al. 2022, appendix B; the practice torchtitan and Megatron log):

    model FLOPs per token = 6 * N + 12 * L * H * D * T

with N the non-embedding parameters (the output head counts: it is a matmul; the input embedding is
a lookup and does not), L layers, H query heads, D head dim, T the sequence length. The factor 6 is
forward (2) plus backward (4) FLOPs per multiply-add. The attention term counts QK^T and AV for all
T x T pairs (causal masking not subtracted, as in PaLM). Recompute from activation checkpointing is
*not* counted in MFU; HFU adds it.

    MFU = model FLOPs per token * tokens per second / (peak FLOP/s per device * devices)

Peak FLOP/s comes from a datasheet table for known accelerators (dense, no sparsity) or, on CPU, a
short matmul benchmark at start-up for the run's dtype, cached per CPU model / thread count. With
``training.fp8`` the peak is the device's dense fp8 peak (twice bf16 on Hopper), so fp8 MFU is not
inflated by the faster matmuls. Each row names its peak in ``mfu_peak`` (``peak_basis``), e.g.
"H100 fp8 datasheet", "cpu float32 measured", "override".
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import time
from pathlib import Path

import torch

from ndtrain import mixer_spec
from ndtrain.config import ModelConfig
from ndtrain.parallel.ac_policy import parse_policy

# Dense peak FLOP/s per device from vendor datasheets (SXM / OAM parts; no 2:4 sparsity).
PEAK_FLOPS = {
    "H100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12, "float64": 66.9e12},
    "H200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12, "float64": 66.9e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12, "float64": 19.5e12},
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "float32": 1125e12, "float64": 40e12},
    "MI300X": {"bfloat16": 1307.4e12, "float16": 1307.4e12, "float32": 653.7e12, "float64": 163.4e12},
}


# Dense fp8 (e4m3) tensor-core peak per device, same sources; absent = no fp8 tensor cores.
FP8_PEAK_FLOPS = {"H100": 1978.9e12, "H200": 1978.9e12, "B200": 4500e12, "MI300X": 2614.9e12}


class UnknownPeak(ValueError):
    """The accelerator is not in the table; MFU is reported as unknown rather than wrong."""


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM convention; see module docstring.

    Counts *active* parameters: an MoE layer contributes its router, shared experts and ``top_k``
    routed experts (not all E); MLA contributes its low-rank projections and latent norms; MTP
    modules add their projection, block, norms and one more pass through the output head. The
    attention term per layer is ``6 * H * (d_qk + d_v) * T`` (= 12 H D T for MHA; MLA has
    d_qk = nope + rope, d_v = v dims); layers with another token mixer (``model.layer_pattern``)
    count that mixer's parameters and sequence term instead (``ndtrain.mixer_spec``: no T term for
    linear mixers, min(w, T) for sliding windows, top-k plus the indexer for DSA).
    """
    d, L, h = cfg.dim, cfg.n_layers, cfg.n_heads
    if cfg.attention == "mla":
        dn, dr = cfg.mla_nope_dim or cfg.head_dim, cfg.mla_rope_dim
        dv, qr, kr = cfg.mla_v_dim or cfg.head_dim, cfg.mla_q_rank, cfg.mla_kv_rank
        q = (d * qr + qr + qr * h * (dn + dr)) if qr else d * h * (dn + dr)
        attn = q + d * (kr + dr) + kr + kr * h * (dn + dv) + h * dv * d
        d_qk, d_v = dn + dr, dv
    else:
        hd, kv = cfg.head_dim, cfg.kv_heads
        attn = d * h * hd * 2 + d * kv * hd * 2 + (2 * hd if cfg.qk_norm else 0)  # wq, wo, wk, wv (q/k norms)
        attn += d * h * hd if cfg.attn_output_gate else 0  # wg (Qwen3-Next gated attention)
        d_qk = d_v = hd

    def layer(i: int) -> int:
        if not cfg.block_ffn:  # mixer-only block (Mamba-2): one norm, no feed-forward
            return attn + d
        if cfg.is_moe_layer(i):  # router + (top_k routed + shared) SwiGLU experts
            ffn = d * cfg.moe_experts + 3 * d * (cfg.expert_ffn_dim * cfg.moe_top_k + cfg.shared_ffn_dim)
            ffn += d if cfg.moe_shared_gate and cfg.moe_shared_experts else 0  # Qwen3-Next shared-expert gate
        else:
            ffn = 3 * d * cfg.ffn_dim
        return attn + ffn + 2 * d  # + two norms

    head = cfg.vocab_size * d
    n_nonembed = sum(layer(i) for i in range(L)) + d + head  # + final norm + output head
    n_nonembed += cfg.mtp_depth * (layer(L - 1) + 2 * d * d + 3 * d + head)  # MTP: block, proj, norms, head
    # per-layer token mixers (layer_pattern): their parameters and sequence term (ndtrain.mixer_spec)
    n_nonembed += mixer_spec.param_delta(cfg, attn)
    mixing = mixer_spec.seq_flops_total(cfg, seq_len, d_qk, d_v)
    return 6.0 * n_nonembed + mixing + 6.0 * cfg.mtp_depth * h * (d_qk + d_v) * seq_len


def _block_forward_flops(cfg: ModelConfig, seq_len: int) -> list[tuple[float, float, float]]:
    """Per decoder block: (forward FLOPs, its last matmul's FLOPs, its attention core's FLOPs) per
    token, the forward being a third of the block's term in ``flops_per_token``."""
    base = dataclasses.replace(cfg, mtp_depth=0)
    hd = cfg.head_dim
    d_qk = (cfg.mla_nope_dim or hd) + cfg.mla_rope_dim if cfg.attention == "mla" else hd
    d_v = (cfg.mla_v_dim or hd) if cfg.attention == "mla" else hd
    core = 2.0 * cfg.n_heads * (d_qk + d_v) * seq_len  # softmax attention's QK^T and AV, all T keys (PaLM)
    kinds = mixer_spec.layer_mixers(cfg.layer_pattern, cfg.n_layers)
    out, prev = [], flops_per_token(dataclasses.replace(base, n_layers=0), seq_len)
    for i in range(cfg.n_layers):  # a prefix of i + 1 layers keeps the pattern (partial periods count)
        cur = flops_per_token(dataclasses.replace(base, n_layers=i + 1), seq_len)
        width = cfg.expert_ffn_dim * cfg.moe_top_k + cfg.shared_ffn_dim if cfg.is_moe_layer(i) else cfg.ffn_dim
        out.append(((cur - prev) / 3.0, 2.0 * cfg.dim * width,  # last matmul: the down projection(s)
                    core if kinds[i] == "attention" else 0.0))
        prev = cur
    return out


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, policy: str) -> float:
    """Forward FLOPs per token that activation checkpointing ``policy`` recomputes in the backward,
    following what ``ndtrain.parallel.activation_ckpt`` does:

    * per-block regions (``full``, and the inner level of ``every:C`` / ``sqrt``) replay their block
      up to its last saved tensor: torch's non-reentrant checkpoint stops early there, so the last
      matmul (the feed-forward down projection, whose output nothing in the block saves) is skipped;
    * a segment region of C > 1 blocks replays blocks 1 .. C-1 whole and stops at block C's input;
    * ``selective`` saves every matmul output and recomputes the softmax-attention core (SDPA is
      not a matmul op) plus elementwise ops, which FLOP counts leave out; other token mixers
      (``model.layer_pattern``) are built from matmuls, whose saved outputs are not recomputed, so
      their layers add nothing here.

    Raises ValueError for an unknown policy.
    """
    kind, c = parse_policy(policy, cfg.n_layers)
    if kind == "none":
        return 0.0
    blocks = _block_forward_flops(cfg, seq_len)
    if kind == "selective":
        return sum(core for _, _, core in blocks)
    extra = 0.0
    for i in range(0, len(blocks), c):
        seg = blocks[i:i + c]
        extra += sum(f - last for f, last, _ in seg)
        if len(seg) > 1:
            extra += sum(f for f, _, _ in seg[:-1])
    return extra


def hfu_factor(cfg: ModelConfig, seq_len: int, policy: str) -> float:
    """HFU / MFU: (model FLOPs + recomputed forward FLOPs) / model FLOPs per token (>= 1).

    Hardware FLOPs utilisation counts the FLOPs the device really runs, including activation
    recomputation (Korthikanti et al. 2022, section 6; Chowdhery et al. 2022, appendix B)."""
    return 1.0 + recompute_flops_per_token(cfg, seq_len, policy) / flops_per_token(cfg, seq_len)


def _gpu_key(name: str) -> str | None:
    return next((key for key in PEAK_FLOPS if key in name.upper().replace(" ", "")), None)


def gpu_peak_flops(name: str, dtype: str, fp8: bool = False) -> float:
    """Peak FLOP/s of a GPU by device name (e.g. "NVIDIA H100 80GB HBM3") for ``dtype``, or its fp8
    peak with ``fp8``; raises UnknownPeak."""
    key = _gpu_key(name)
    if key is not None and (not fp8 or key in FP8_PEAK_FLOPS):
        return FP8_PEAK_FLOPS[key] if fp8 else PEAK_FLOPS[key][dtype]
    raise UnknownPeak(f"unknown {'fp8 ' if fp8 else ''}peak FLOP/s for {name!r}; set logging.peak_flops_per_s")


def peak_basis(device: torch.device, dtype: str, override: float = 0.0, fp8: bool = False) -> str:
    """Which peak ``peak_flops`` returns, in words (the ``mfu_peak`` field of metrics rows):
    "override", "<GPU> <fp8|dtype> datasheet", "cpu <dtype> measured", or "unknown"."""
    if override > 0:
        return "override"
    if device.type == "cuda":
        key = _gpu_key(torch.cuda.get_device_name(device))
        ok = key is not None and (not fp8 or key in FP8_PEAK_FLOPS)
        return f"{key} {'fp8' if fp8 else dtype} datasheet" if ok else "unknown"
    return f"cpu {'best of bfloat16 / float32' if dtype == 'float16' else dtype} measured"


def _cache_dir() -> Path:
    return Path(os.environ.get("NDTRAIN_CACHE", Path.home() / ".cache" / "ndtrain"))


def cpu_peak_flops(dtype: str, n: int = 1024, seconds: float = 0.4) -> float:
    """Matmul FLOP/s of this process on CPU for ``dtype``: the best of this start-up's measurement
    and every earlier one on this CPU / thread count (cached on disk).

    Times square (n x n) @ (n x n) matmuls in short windows for about ``seconds`` and keeps the best
    window. Keeping the maximum across runs matters on a shared machine: a peak measured while other
    processes compete would be too low and would inflate MFU past 100%; the best observed rate is
    the honest estimate of what the hardware can do.
    """
    threads = torch.get_num_threads()
    key = f"{platform.processor() or platform.machine()}-{threads}t-{dtype}-{n}-torch{torch.__version__}"
    path = _cache_dir() / "cpu_peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    a @ b
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(2):
            a @ b
        best = max(best, 2 * 2 * n**3 / (time.perf_counter() - t0))
    best = max(best, cache.get(key, 0.0))
    cache[key] = best
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return best


def peak_flops(device: torch.device, dtype: str, override: float = 0.0, fp8: bool = False) -> float | None:
    """Peak FLOP/s of one device: override, datasheet table (the fp8 peak with ``fp8``), or CPU
    benchmark; None if unknown. ``peak_basis`` names which."""
    if override > 0:
        return override
    if device.type == "cuda":
        try:
            return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, fp8)
        except UnknownPeak:
            return None
    if dtype == "float16":
        # CPUs without native fp16 matmul run a plain fp16 matmul on a slow path (about 1 GFLOP/s
        # here), while fp16 autocast kernels do far better; the honest ceiling is the best of the
        # native paths, so MFU can never read above 100%.
        return max(cpu_peak_flops("bfloat16"), cpu_peak_flops("float32"))
    return cpu_peak_flops(dtype)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA max allocated, or the process's max RSS on CPU (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLog:
    """Appends one JSON object per logged step to ``RUN_DIR/metrics.jsonl`` and prints a line."""

    def __init__(self, run_dir: Path, enabled: bool, keep_through_step: int = 0, echo=None):
        """Rows of an earlier job in the same run directory with ``step > keep_through_step`` are
        dropped (they are being redone: after a resume from that step, or a fresh start at 0), so the
        file always holds one row per logged step. The dropped rows go to ``metrics.prev.jsonl``.
        ``echo(row)`` shows each row (default: print ``format_line``; the trainer passes its
        ``ndtrain.train.console.RunConsole.row``)."""
        self.enabled = enabled
        self.echo = echo or (lambda row: print(format_line(row), flush=True))
        self.path = Path(run_dir) / "metrics.jsonl"
        self.rows: list[dict] = []
        if enabled and self.path.exists():
            old = read_metrics(run_dir)
            keep = [r for r in old if r["step"] <= keep_through_step and keep_through_step > 0]
            if len(keep) < len(old):
                with open(self.path.with_name("metrics.prev.jsonl"), "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in old if r not in keep)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def log(self, row: dict) -> None:
        """Append ``row`` with a ``time`` field (Unix seconds, when it was logged) and echo it."""
        if not self.enabled:
            return
        row.setdefault("time", round(time.time(), 3))
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.echo(row)


# (row key, console format) in print order; a key absent from the row is left out of the line.
_LINE_FIELDS = (
    ("loss", "loss {:.4f}"), ("val_loss", "val {:.4f}"), ("lr", "lr {:.2e}"),
    ("grad_norm", "gnorm {:.3f}"), ("tokens_per_s", "{:,.0f} tok/s"),
    ("aux_loss", "aux {:.4f}"), ("mtp_loss", "mtp {:.4f}"),
)


def format_line(row: dict) -> str:
    """One console line for a metrics row: step, losses, lr, throughput, MFU, MoE load, memory."""
    parts = [f"step {row['step']:>5}"]
    parts += [fmt.format(row[key]) for key, fmt in _LINE_FIELDS[:5] if key in row]
    if "mfu" in row:
        basis = f" of {row['mfu_peak']} peak" if row.get("mfu_peak") and row["mfu"] is not None else ""
        parts.append("mfu unknown peak" if row["mfu"] is None else f"mfu {100 * row['mfu']:.1f}%{basis}")
    if row.get("hfu") is not None:
        parts.append(f"hfu {100 * row['hfu']:.1f}%")
    parts += [fmt.format(row[key]) for key, fmt in _LINE_FIELDS[5:] if key in row]
    if "moe_load_max_mean" in row:
        parts.append(_moe_part(row))
    if "peak_mem_bytes" in row:
        parts.append(f"mem {row['peak_mem_bytes'] / 2**20:,.0f} MiB")
    return " | ".join(parts)


def _moe_part(row: dict) -> str:
    """MoE load of the step (``ndtrain.model.moe_balance.end_step``): max/mean ratio, the busiest
    expert's and the mean tokens per expert over the global batch, dropped share, and the expert-
    parallel all-to-all bytes of the step summed over ranks (shown when non-zero)."""
    part = f"load max/mean {row['moe_load_max_mean']:.2f}"
    if "moe_tokens_per_expert_max" in row:
        part += f" ({row['moe_tokens_per_expert_max']:,.0f}/{row['moe_tokens_per_expert_mean']:,.0f} tok)"
    part += f" drop {100 * row['moe_dropped_frac']:.1f}%"
    if row.get("moe_a2a_bytes"):
        part += f" a2a {row['moe_a2a_bytes'] / 2**20:,.1f} MiB"
    return part


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, title: str | None = None) -> Path:
    """Write ``RUN_DIR/loss.png``: train / validation loss, learning rate and MFU against step,
    titled ``title`` (default: the run directory's name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = loss_figure(read_metrics(run_dir), title or Path(run_dir).resolve().name)
    out = Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def loss_figure(rows: list[dict], title: str):
    """The matplotlib figure of ``plot_run``: loss panel (train, val), LR panel, MFU panel."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax_lr, ax2) = plt.subplots(3, 1, figsize=(7, 8), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1, 1.5]})
    fig.suptitle(title)
    tr = [r for r in rows if "loss" in r]
    va = [r for r in rows if "val_loss" in r]
    ax1.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train loss")
    if va:
        ax1.plot([r["step"] for r in va], [r["val_loss"] for r in va], "o-", label="val loss")
    ax1.set_ylabel("loss (nats/token)")
    ax1.legend()
    lr = [r for r in tr if r.get("lr") is not None]
    ax_lr.plot([r["step"] for r in lr], [r["lr"] for r in lr], color="tab:orange")
    ax_lr.set_ylabel("learning rate")
    mf = [r for r in tr if r.get("mfu") is not None]
    ax2.plot([r["step"] for r in mf], [100 * r["mfu"] for r in mf], color="tab:green")
    ax2.set_ylabel("MFU (%)")
    ax2.set_xlabel("step")
    fig.tight_layout()
    return fig
