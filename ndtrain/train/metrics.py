"""FLOPs per token, MFU / HFU, peak memory, and the metrics log (console line + JSONL + plot).

Every ``metrics.jsonl`` row carries ``step`` and ``time`` (Unix seconds when it was logged).

MFU convention (PaLM, Chowdhery et al. 2022, appendix B; the practice torchtitan and Megatron log):

    model FLOPs per token = 6 * N + 12 * L * H * D * T

with N the non-embedding parameters (the output head counts: it is a matmul; the input embedding is
a lookup and does not), L layers, H query heads, D head dim, T the sequence length. The count is the
planner's (``ndtrain.planner.model_spec.ModelSpec.flops_per_token``): the plan and the logged MFU
share one formula. Recompute from activation checkpointing is *not* counted in MFU; HFU adds it.

    MFU = model FLOPs per token * tokens per second / (peak FLOP/s per device * devices)

Peak FLOP/s (``ndtrain.train.peak``) comes from the planner's datasheet table for known
accelerators (dense, no sparsity; with ``training.fp8`` the dense fp8 peak, twice bf16 on Hopper,
so fp8 MFU is not inflated by the faster matmuls) or, on CPU, a short matmul benchmark at start-up.
Each row names its peak in ``mfu_peak`` (``peak_basis``), e.g. "H100 fp8 datasheet", "cpu float32
measured", "override"; a CPU peak that looks measured on a busy machine says "... under load".
"""
from __future__ import annotations

import dataclasses
import json
import resource
import time
from pathlib import Path

import torch

from ndtrain.config import ModelConfig
from ndtrain.mixer_spec import layer_mixers
from ndtrain.parallel.ac_policy import parse_policy
from ndtrain.planner.model_spec import from_model_config
from ndtrain.train.peak import (  # noqa: F401  (the trainer's MFU entry points: metrics.peak_flops ...)
    UnknownPeak,
    cpu_peak_flops,
    gpu_peak_flops,
    peak_basis,
    peak_flops,
    recheck_cpu_peak,
)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM convention: the planner's count
    (``ModelSpec.flops_per_token``: active parameters only for MoE, MLA projections, MTP modules,
    each layer's token mixer per ``ndtrain.mixer_spec``)."""
    return from_model_config(cfg).flops_per_token(seq_len)


def _block_forward_flops(cfg: ModelConfig, seq_len: int) -> list[tuple[float, float, float]]:
    """Per decoder block: (forward FLOPs, its last matmul's FLOPs, its attention core's FLOPs) per
    token, the forward being a third of the block's term in ``flops_per_token``."""
    base = dataclasses.replace(cfg, mtp_depth=0)
    core = from_model_config(base).attention_flops_per_layer(seq_len) / 3.0  # softmax QK^T, AV forward
    kinds = layer_mixers(cfg.layer_pattern, cfg.n_layers)
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
    * ``op`` keeps matmul and fused-attention outputs: nothing FLOP counts see is recomputed;
      ``core_attn`` recomputes the softmax-attention core; ``deepseek`` its norms (no FLOPs here)
      and, on MLA, the up-projections with the core they feed (the small up-projection matmuls
      are left out);
    * ``selective`` saves every matmul output and recomputes the softmax-attention core (SDPA is
      not a matmul op) plus elementwise ops, which FLOP counts leave out; other token mixers
      (``model.layer_pattern``) are built from matmuls, whose saved outputs are not recomputed, so
      their layers add nothing here.

    Raises ValueError for an unknown policy.
    """
    kind, c = parse_policy(policy, cfg.n_layers)
    if kind == "none" or policy == "op":  # op keeps matmul and fused-attention outputs
        return 0.0
    blocks = _block_forward_flops(cfg, seq_len)
    if kind == "selective" or policy == "core_attn" or (policy == "deepseek" and cfg.attention == "mla"):
        return sum(core for _, _, core in blocks)  # deepseek: MLA's core reruns with its up-projections
    if kind == "parts":  # deepseek without MLA: norms only, no matmul FLOPs
        return 0.0
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
    parts += [fmt.format(row[key]) for key, fmt in _LINE_FIELDS[:2] if key in row]
    parts += [f"val/{key[9:]} {value:.4f}" for key, value in row.items() if key.startswith("val_loss/")]
    parts += [fmt.format(row[key]) for key, fmt in _LINE_FIELDS[2:5] if key in row]
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
    if shares := {k[len("data_share_"):]: v for k, v in row.items() if k.startswith("data_share_")}:
        parts.append("mix " + " ".join(f"{n} {100 * v:.1f}%" for n, v in shares.items()))  # data.sources
    return " | ".join(parts)


def _moe_part(row: dict) -> str:
    """MoE load of the step (``ndtrain.model.moe_balance.end_step``): max/mean ratio, the busiest
    expert's and the mean tokens per expert over the global batch, dropped share, and the expert-
    parallel all-to-all bytes of the step summed over ranks (shown when non-zero)."""
    part = f"load max/mean {row['moe_load_max_mean']:.2f}"
    if row.get("moe_routing") == "balanced":  # benchmark rows say so on every line
        part = "moe_routing: balanced | " + part
    if "moe_tokens_per_expert_max" in row:
        part += f" ({row['moe_tokens_per_expert_max']:,.0f}/{row['moe_tokens_per_expert_mean']:,.0f} tok)"
    part += f" drop {100 * row['moe_dropped_frac']:.1f}%"
    if row.get("moe_a2a_bytes"):
        part += f" a2a {row['moe_a2a_bytes'] / 2**20:,.1f} MiB"
        if "moe_tokens_per_ep_rank_max" in row:  # only with ep > 1 (a2a bytes) is a rank not the whole
            part += f" ep-rank {row['moe_tokens_per_ep_rank_max']:,.0f}/{row['moe_tokens_per_ep_rank_mean']:,.0f} tok"
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
    for key in dict.fromkeys(k for r in rows for k in r if k.startswith("val_loss/")):  # eval.sets
        ax1.plot([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r], "o--",
                 label=key.replace("_loss", ""))
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
