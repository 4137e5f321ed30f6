"""Accelerators and clusters: peak FLOP/s, memory, memory bandwidth and link bandwidths.

Every number is a vendor datasheet figure (dense, i.e. without 2:4 sparsity; SXM / OAM parts) so
the planner's inputs can be checked; what the software actually reaches is modelled separately by
the two global efficiency constants below. Units: FLOP/s, bytes, bytes/s (per direction, per GPU),
seconds. Link bandwidths are *unidirectional per GPU*: NVIDIA quotes NVLink as the bidirectional
total (H100: 900 GB/s = 18 links x 25 GB/s x 2 directions), a ring collective sends and receives
at the same time, so its per-direction figure (450 GB/s) is what the alpha-beta model divides by.

Sources:
  H100 SXM5:  NVIDIA H100 Tensor Core GPU datasheet (2023): BF16 989.4 TFLOP/s dense, FP8 1,978.9,
              TF32 494.7, FP32 66.9; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s; ConnectX-7 NDR
              400 Gb/s per GPU (DGX H100 user guide).
  H200 SXM:   NVIDIA H200 datasheet (2024): same tensor cores as H100; 141 GB HBM3e at 4.8 TB/s.
  A100 SXM4:  NVIDIA A100 datasheet (2021): BF16 312 TFLOP/s, TF32 156, FP32 19.5; 40 GB HBM2 at
              1,555 GB/s or 80 GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s; HDR 200 Gb/s per GPU.
  B200:       NVIDIA HGX B200 datasheet (2024), per GPU = HGX / 8, halved for sparsity: BF16 2.25
              PFLOP/s, FP8 4.5, TF32 1.1; 180 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s; 400 Gb/s NIC.
  MI300X:     AMD Instinct MI300X datasheet (2023): BF16 1,307.4 TFLOP/s, FP8 2,614.9, FP32 matrix
              163.4; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links x 64 GB/s per direction.
  attention_gemm_ratio: FlashAttention-2 (Dao 2023) reaches ~225 TFLOP/s fwd+bwd on A100 (73% of
              peak, ~0.85 of cuBLAS GEMM) but only ~335 TFLOP/s on H100 (35% of peak; Shah et al.
              2024, FlashAttention-3, section 1), about half of what cuBLAS GEMMs reach there: 0.5
              for Hopper and for the parts without published FA numbers (B200, MI300X, cpu).
  cpu:        placeholders for this kind of machine; ``ndtrain plan --measure`` replaces the peak and
              the loopback (gloo) bandwidth with measured values.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

MiB, GiB = 2**20, 2**30

# The global efficiency constants (the only tuning knobs of the time model; never set per case).
# COMPUTE_EFFICIENCY: the share of dense peak a training step's compute phase reaches when nothing
#   else (communication, pipeline bubble) is in the way: GEMMs plus the memory-bound kernels between
#   them (norms, RoPE, SwiGLU, residuals, cross entropy), launch gaps and sustained-load clocks. The
#   seed lecture measures exactly this: one H100 training a wide MLP with a huge batch reaches about
#   50% MFU (while a bare matmul loop reaches ~80% HFU). 0.5 for every accelerator and every case.
#   FlashAttention runs at ``Accelerator.attention_gemm_ratio`` x this rate on the FLOPs it executes
#   (the causal half of the T x T pairs); see timing.py.
# BANDWIDTH_EFFICIENCY: the share of nominal link bandwidth NCCL's ring / tree reaches for large
#   messages (nccl-tests bus bandwidth: ~370-400 GB/s of 450 on NVLink 4, ~40-45 GB/s of 50 on NDR).
COMPUTE_EFFICIENCY = 0.5
BANDWIDTH_EFFICIENCY = 0.85


@dataclass(frozen=True)
class Accelerator:
    """One device type. ``peak_flops_per_s`` maps dtype name -> dense FLOP/s."""

    name: str
    peak_flops_per_s: dict = field(default_factory=dict)  # dtype -> FLOP/s (dense)
    hbm_bytes: float = 0.0  # device memory the allocator can use (bytes)
    hbm_bytes_per_s: float = 0.0  # device memory bandwidth (bytes/s)
    intra_node_bytes_per_s: float = 0.0  # NVLink / Infinity Fabric, per GPU per direction
    inter_node_bytes_per_s: float = 0.0  # NIC per GPU per direction (IB / RoCE)
    intra_node_latency_s: float = 3e-6  # alpha of one collective step inside a node
    inter_node_latency_s: float = 10e-6  # alpha of one collective step across nodes
    gpus_per_node: int = 8
    runtime_reserve_bytes: float = 1.0 * GiB  # CUDA context, NCCL buffers, allocator slack
    attention_gemm_ratio: float = 0.5  # FlashAttention fwd+bwd throughput / dense GEMM throughput
    source: str = ""

    def peak(self, dtype: str = "bfloat16") -> float:
        """Dense peak FLOP/s for ``dtype`` (aliases: bf16, fp16, fp32, tf32, fp8); raises KeyError."""
        key = _DTYPE_ALIASES.get(dtype, dtype)
        if key not in self.peak_flops_per_s:
            raise KeyError(f"{self.name} has no peak for dtype {dtype!r}; "
                           f"known: {', '.join(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[key]


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                  "float": "float32", "fp8": "float8"}


def _gpu(name, bf16, fp8, tf32, fp32, hbm, hbm_bw, nvlink_bidir, nic_bits, source, attn=0.5, **kw):
    flops = {"bfloat16": bf16, "float16": bf16, "tf32": tf32, "float32": fp32}
    if fp8:
        flops["float8"] = fp8
    return Accelerator(name, flops, hbm, hbm_bw, nvlink_bidir / 2, nic_bits / 8, source=source,
                       attention_gemm_ratio=attn, **kw)


HARDWARE: dict[str, Accelerator] = {
    # nvidia-smi reports 81,559 MiB for H100 80GB and 81,920 MiB for A100 80GB.
    "H100": _gpu("H100", 989.4e12, 1978.9e12, 494.7e12, 66.9e12, 81559 * MiB, 3.35e12, 900e9, 400e9,
                 "NVIDIA H100 SXM5 datasheet"),
    "H200": _gpu("H200", 989.4e12, 1978.9e12, 494.7e12, 66.9e12, 141e9, 4.8e12, 900e9, 400e9,
                 "NVIDIA H200 SXM datasheet"),
    "A100-40GB": _gpu("A100-40GB", 312e12, 0, 156e12, 19.5e12, 40960 * MiB, 1.555e12, 600e9, 200e9,
                      "NVIDIA A100 SXM4 datasheet", attn=0.85),
    "A100-80GB": _gpu("A100-80GB", 312e12, 0, 156e12, 19.5e12, 81920 * MiB, 2.039e12, 600e9, 200e9,
                      "NVIDIA A100 SXM4 datasheet", attn=0.85),
    "B200": _gpu("B200", 2.25e15, 4.5e15, 1.1e15, 75e12, 180e9, 8e12, 1.8e12, 400e9,
                 "NVIDIA HGX B200 datasheet (per GPU, dense)"),
    "MI300X": _gpu("MI300X", 1307.4e12, 2614.9e12, 653.7e12, 163.4e12, 192e9, 5.3e12, 7 * 128e9, 400e9,
                   "AMD Instinct MI300X datasheet"),
    # A CPU "node": one process per core group, gloo over loopback within the node, 10 GbE across.
    "cpu": Accelerator("cpu", {"float32": 5e10, "bfloat16": 1e10, "float16": 5e9}, hbm_bytes=16 * GiB,
                       hbm_bytes_per_s=20e9, intra_node_bytes_per_s=2e9, inter_node_bytes_per_s=1.25e9,
                       intra_node_latency_s=20e-6, inter_node_latency_s=50e-6, gpus_per_node=2,
                       runtime_reserve_bytes=0.35 * GiB,
                       source="placeholder; `ndtrain plan --measure` measures peak and gloo bandwidth"),
}
ALIASES = {"A100": "A100-80GB", "H100-80GB": "H100", "H100-SXM": "H100", "MI300": "MI300X"}


def get_accelerator(name: str) -> Accelerator:
    """Look up an accelerator by name (case-insensitive); raises ValueError listing known names."""
    table = {k.lower(): v for k, v in HARDWARE.items()}
    table.update({k.lower(): HARDWARE[v] for k, v in ALIASES.items()})
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None


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
        return self.accelerator.peak(self.dtype)

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
