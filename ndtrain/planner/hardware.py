"""Clusters, the accelerator lookup and its overrides, and the two global efficiency constants.

The accelerator table (datasheet numbers, one cited source per entry) is ``accelerators.py``.
Units: FLOP/s, bytes, bytes/s (per direction, per device), seconds. Link bandwidths are
*unidirectional per device*: a ring collective sends and receives at the same time, so the
per-direction figure (H100: 450 of NVLink 4's 900 GB/s bidirectional) is what the alpha-beta model
divides by.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ndtrain.planner.accelerators import ALIASES, DTYPE_ALIASES, HARDWARE, Accelerator, GiB, MiB

__all__ = ["ALIASES", "BANDWIDTH_EFFICIENCY", "COMPUTE_EFFICIENCY", "DTYPE_ALIASES", "HARDWARE", "Accelerator",
           "Cluster", "GiB", "MiB", "apply_overrides", "device_accelerator", "get_accelerator"]

# The global efficiency constants (never set per case).
# COMPUTE_EFFICIENCY: v1's flat share of dense peak for a training step's compute phase, from the
#   seed lecture (one H100 training a wide MLP with a huge batch reaches about 50% MFU while a bare
#   matmul loop reaches ~80% HFU). The per-operation model (``compute.GENERATIONS``) replaced it
#   for every accelerator with a generation entry; it remains (as ``compute.FLAT_EFFICIENCY``) the
#   GEMM share of accelerators without one (cpu, custom ``--hardware-override`` bases) and the
#   coarse rate at which ``comm.moe_all_to_all`` counts the compute an all-to-all can hide behind
#   (shared experts, DualPipeV's other microbatch). ``--efficiency e`` replaces it by e everywhere
#   in the flat model (every GEMM at e x peak, attention at e x ``attention_gemm_ratio``).
# BANDWIDTH_EFFICIENCY: the share of nominal link bandwidth NCCL's ring / tree reaches for large
#   messages (nccl-tests bus bandwidth: ~370-400 GB/s of 450 on NVLink 4, ~40-45 GB/s of 50 on NDR).
COMPUTE_EFFICIENCY = 0.5
BANDWIDTH_EFFICIENCY = 0.85


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def get_accelerator(name: str) -> Accelerator:
    """Look up an accelerator by name, ignoring case, spaces, '-' and '_' ("TPU v4", "tpu-v4",
    "H100 SXM"); raises ValueError listing the known names."""
    table = {_key(k): v for k, v in HARDWARE.items()}
    table.update({_key(k): HARDWARE[v] for k, v in ALIASES.items()})
    try:
        return table[_key(name)]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None


def device_accelerator(device_name: str) -> str | None:
    """The ``HARDWARE`` key a torch device name names (``torch.cuda.get_device_name``, e.g.
    "NVIDIA H100 80GB HBM3" -> "H100", "NVIDIA A100-SXM4-40GB" -> "A100-80GB" (same compute), "NVIDIA
    H100 NVL" -> "H100-NVL"), or None. The longest table name or alias inside the name wins; aliases
    under 4 characters ("v4") are too short to find inside a device name."""
    name = _key(device_name)
    names = {_key(k): k for k in HARDWARE if k != "cpu"}
    names.update({_key(a): k for a, k in ALIASES.items() if len(_key(a)) >= 4})
    hits = [n for n in names if n in name]
    return names[max(hits, key=len)] if hits else None


# --hardware-override keys -> (Accelerator field or peak dtypes, factor to the field's unit)
OVERRIDES = {
    "memory_gb": ("hbm_bytes", 1e9), "memory_gib": ("hbm_bytes", GiB),
    "peak_tflops": (("bfloat16", "float16"), 1e12), "fp8_tflops": (("float8",), 1e12),
    "fp32_tflops": (("float32",), 1e12), "tf32_tflops": (("tf32",), 1e12),
    "hbm_tbps": ("hbm_bytes_per_s", 1e12), "intra_node_gbps": ("intra_node_bytes_per_s", 1e9),
    "inter_node_gbps": ("inter_node_bytes_per_s", 1e9), "gpus_per_node": ("gpus_per_node", 1),
    "intra_node_latency_us": ("intra_node_latency_s", 1e-6),
    "inter_node_latency_us": ("inter_node_latency_s", 1e-6),
    "runtime_reserve_gib": ("runtime_reserve_bytes", GiB), "attention_gemm_ratio": ("attention_gemm_ratio", 1),
}


def apply_overrides(acc: Accelerator, text: str) -> Accelerator:
    """``acc`` with fields replaced from "key=value,..." (``--hardware-override``). Keys and units:
    memory_gb / memory_gib, peak_tflops (dense bf16 and fp16), fp8_tflops, fp32_tflops, tf32_tflops,
    hbm_tbps (TB/s), intra_node_gbps / inter_node_gbps (GB/s per direction), gpus_per_node,
    intra_node_latency_us / inter_node_latency_us, runtime_reserve_gib, attention_gemm_ratio.
    Raises ValueError naming an unknown key or a bad value."""
    changes, peaks = {}, dict(acc.peak_flops_per_s)
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if key not in OVERRIDES:
            raise ValueError(f"--hardware-override: unknown key {key!r}; known: {', '.join(OVERRIDES)}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--hardware-override: {key} needs a number, got {value.strip()!r}") from None
        if not eq or number <= 0:
            raise ValueError(f"--hardware-override: {key} needs a positive number")
        target, unit = OVERRIDES[key]
        if isinstance(target, tuple):
            peaks.update({d: number * unit for d in target})
        else:
            changes[target] = int(number) if target == "gpus_per_node" else number * unit
    src = f"{acc.source}; overridden: {text}" if acc.source else f"overridden: {text}"
    return replace(acc, peak_flops_per_s=peaks, source=src, **changes)


@dataclass(frozen=True)
class Cluster:
    """``gpus`` accelerators, ``gpus_per_node`` per node; optionally pods of ``pod_gpus``.

    Link fields of 0 take the accelerator's defaults. ``price_per_gpu_hour`` is in dollars.
    """

    accelerator: Accelerator
    gpus: int
    gpus_per_node: int = 0
    intra_node_bytes_per_s: float = 0.0
    inter_node_bytes_per_s: float = 0.0
    pod_gpus: int = 0  # 0 = no pod level
    inter_pod_bytes_per_s: float = 0.0
    price_per_gpu_hour: float = 2.0
    dtype: str = "bfloat16"

    def __post_init__(self):
        a = self.accelerator
        if self.gpus < 1:
            raise ValueError(f"gpus ({self.gpus}) must be >= 1")
        for name, default in (("gpus_per_node", a.gpus_per_node),
                              ("intra_node_bytes_per_s", a.intra_node_bytes_per_s),
                              ("inter_node_bytes_per_s", a.inter_node_bytes_per_s)):
            if not getattr(self, name):
                object.__setattr__(self, name, default)
        if self.gpus_per_node > self.gpus:
            object.__setattr__(self, "gpus_per_node", self.gpus)
        if self.pod_gpus and not self.inter_pod_bytes_per_s:
            object.__setattr__(self, "inter_pod_bytes_per_s", self.inter_node_bytes_per_s)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def peak_flops_per_s(self) -> float:
        """Dense peak FLOP/s of ``dtype``: the rate of the blocks' linear layers."""
        return self.accelerator.peak(self.dtype)

    @property
    def is_fp8(self) -> bool:
        return DTYPE_ALIASES.get(self.dtype, self.dtype) == "float8"

    @property
    def mfu_peak_flops_per_s(self) -> float:
        """The peak MFU is reported against (FLOP/s): the bf16 dense peak under float8 (the published
        convention, e.g. DeepSeek-V3's and Llama's MFU are vs the bf16 peak), else ``dtype``'s. It
        is also the rate of the tensors float8 training keeps in 16 bits."""
        return self.accelerator.peak("bfloat16") if self.is_fp8 else self.peak_flops_per_s

    def precision_note(self) -> str:
        """Which tensors run in which precision, and what MFU is measured against ("" for 16/32-bit)."""
        if not self.is_fp8:
            return ""
        t = 1e12
        return (f"float8: the GEMMs of the blocks' linear layers (QKV / output projections, SwiGLU, "
                f"experts; forward, input and weight gradients) run at the FP8 peak "
                f"({self.peak_flops_per_s / t:,.0f} TFLOP/s) at 0.85 of the 16-bit GEMMs' share of peak, "
                "plus the casts and amax reductions of their operands at HBM bandwidth; attention, the output head, embedding, "
                f"norms and all communication stay bf16 ({self.mfu_peak_flops_per_s / t:,.0f} TFLOP/s); "
                "activations are stored in bf16 and weights / gradients / optimizer state follow "
                "--precision. MFU is against the bf16 dense peak (the published convention); "
                "mfu_vs_dtype_peak is against the FP8 peak")

    def link(self, span: int) -> tuple[str, float, float]:
        """The slowest link a group of consecutive ranks spanning ``span`` GPUs crosses.

        Returns (name, bytes/s per direction, latency s). A ring over a group that leaves the node
        is bounded by the per-GPU NIC (NCCL runs one ring per NIC), one that leaves the pod by the
        pod uplink.
        """
        a = self.accelerator
        if span <= self.gpus_per_node:
            return "intra-node", self.intra_node_bytes_per_s, a.intra_node_latency_s
        if self.pod_gpus and span > self.pod_gpus:
            return "inter-pod", self.inter_pod_bytes_per_s, 2 * a.inter_node_latency_s
        return "inter-node", self.inter_node_bytes_per_s, a.inter_node_latency_s

    def with_accelerator(self, **changes) -> Cluster:
        return replace(self, accelerator=replace(self.accelerator, **changes))
