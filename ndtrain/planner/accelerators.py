"""The accelerator table: datasheet peak FLOP/s, memory, memory bandwidth and link bandwidths.

Every number is a vendor datasheet figure, dense (without 2:4 sparsity: NVIDIA quotes sparse
figures with an asterisk, halved here), per device. Units: FLOP/s, bytes, bytes/s. Link bandwidths
are stored *per direction per device*: NVIDIA quotes NVLink as the bidirectional total (H100:
900 GB/s = 18 links x 25 GB/s x 2), so ``_gpu`` halves it; NICs are given in bits/s per direction.
The "node" of an entry is its fast-link domain: 8 GPUs on an HGX board, 72 on GB200 NVL72, a whole
ICI slice for TPUs (whose data-center network, DCN, is the "inter-node" link).

``attention_gemm_ratio``: FlashAttention-2 (Dao 2023) reaches ~73% of A100 peak (~0.85 of cuBLAS)
but ~35% of H100 peak (Shah et al. 2024, FlashAttention-3, section 1), about half of GEMMs there:
0.5 for Hopper and for parts without published FA numbers (Blackwell, MI300X, TPU, cpu).
"""
from __future__ import annotations

from dataclasses import dataclass, field

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Accelerator:
    """One device type. ``peak_flops_per_s`` maps dtype name -> dense FLOP/s."""

    name: str
    peak_flops_per_s: dict = field(default_factory=dict)  # dtype -> FLOP/s (dense)
    hbm_bytes: float = 0.0  # device memory the allocator can use (bytes)
    hbm_bytes_per_s: float = 0.0  # device memory bandwidth (bytes/s)
    intra_node_bytes_per_s: float = 0.0  # NVLink / Infinity Fabric / ICI, per device per direction
    inter_node_bytes_per_s: float = 0.0  # NIC (IB / RoCE / DCN) per device per direction
    intra_node_latency_s: float = 3e-6  # alpha of one collective step inside a node
    inter_node_latency_s: float = 10e-6  # alpha of one collective step across nodes
    gpus_per_node: int = 8  # devices in one fast-link domain
    runtime_reserve_bytes: float = 1.0 * GiB  # CUDA context, NCCL buffers
    allocator_overhead: float = 1.10  # factor on activation / loss bytes: caching-allocator fragmentation
    torus_dims: int = 0  # > 0: the fast-link domain is a torus of this many dims (TPU ICI, torus.py)
    attention_gemm_ratio: float = 0.5  # FlashAttention fwd+bwd throughput / dense GEMM throughput
    compute_efficiency: float = 0.0  # > 0: every GEMM at this share of peak (--efficiency); 0: compute.py
    source: str = ""

    def peak(self, dtype: str = "bfloat16") -> float:
        """Dense peak FLOP/s for ``dtype`` (aliases: bf16, fp16, fp32, tf32, fp8); raises KeyError."""
        key = DTYPE_ALIASES.get(dtype, dtype)
        if key not in self.peak_flops_per_s:
            raise KeyError(f"{self.name} has no peak for dtype {dtype!r}; "
                           f"known: {', '.join(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[key]


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                 "float": "float32", "fp8": "float8"}


def _gpu(name, bf16, fp8, tf32, fp32, hbm, hbm_bw, nvlink_bidir, nic_bits, source, attn=0.5, fp64=0.0, **kw):
    """An entry from datasheet units: FLOP/s, bytes, bytes/s, NVLink bidirectional bytes/s, NIC bits/s;
    ``fp64``: the FP64 tensor-core (AMD: matrix) peak, where the datasheet gives one."""
    flops = {"bfloat16": bf16, "float16": bf16}
    named = (("tf32", tf32), ("float32", fp32), ("float8", fp8), ("float64", fp64))
    flops.update({k: v for k, v in named if v})
    return Accelerator(name, flops, hbm, hbm_bw, nvlink_bidir / 2, nic_bits / 8, source=source,
                       attention_gemm_ratio=attn, **kw)


def _tpu(name, bf16, fp8, hbm, hbm_bw, ici_bidir, dcn_bits, slice_chips, source):
    """A TPU: the ICI slice is the "node", a 3-D torus: ``ici_bidir`` / 2 per direction over 6
    links (2 per dimension), collectives costed per torus dimension (``torus.py``)."""
    return _gpu(name, bf16, fp8, 0, 0, hbm, hbm_bw, ici_bidir, dcn_bits, source, gpus_per_node=slice_chips,
                inter_node_latency_s=20e-6, torus_dims=3)


T, P = 1e12, 1e15
HARDWARE: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: BF16 1,979 / FP8 3,958 TFLOP/s with sparsity,
    # TF32 989, FP32 67, FP64 tensor core 67; 80 GB HBM3 (nvidia-smi: 81,559 MiB) at 3.35 TB/s;
    # NVLink 4 900 GB/s; ConnectX-7 NDR 400 Gb/s per GPU (DGX H100 user guide).
    "H100": _gpu("H100", 989.4 * T, 1978.9 * T, 494.7 * T, 66.9 * T, 81559 * MiB, 3.35e12, 900e9, 400e9,
                 "NVIDIA H100 SXM5 datasheet", fp64=66.9e12),
    # H100 SXM5 96 GB: the same die and clocks with all six HBM3 stacks enabled (96 GB, as GH200-96GB);
    # NVIDIA's H100 datasheet does not list it, so its memory bandwidth is assumed equal to the 80 GB
    # part's 3.35 TB/s (override with --hardware-override hbm_tbps=...).
    "H100-96GB": _gpu("H100-96GB", 989.4 * T, 1978.9 * T, 494.7 * T, 66.9 * T, 96e9, 3.35e12, 900e9, 400e9,
                      "NVIDIA H100 SXM5 datasheet (compute, links); 96 GB HBM3 variant, bandwidth assumed",
                      fp64=66.9e12),
    # Same datasheet, H100 NVL column (PCIe card, NVLink bridge pairs): BF16 1,671 / FP8 3,341 sparse,
    # TF32 835, FP32 60; 94 GB HBM3 (of the 96 GB stacks) at 3.9 TB/s; NVLink bridge 600 GB/s between
    # the 2 GPUs of a pair (the "node" here); 400 Gb/s NIC per GPU assumed.
    "H100-NVL": _gpu("H100-NVL", 835.5 * T, 1670.5 * T, 417.5 * T, 60 * T, 94e9, 3.9e12, 600e9, 400e9,
                     "NVIDIA H100 NVL datasheet", gpus_per_node=2),
    # NVIDIA H800 SXM5 (export variant of H100 SXM5): same tensor cores and 80 GB HBM3 at 3.35 TB/s,
    # NVLink cut to 400 GB/s; 8 x 400 Gb/s IB per node (DeepSeek-V3 report, section 3.1).
    "H800": _gpu("H800", 989.4 * T, 1978.9 * T, 494.7 * T, 66.9 * T, 81559 * MiB, 3.35e12, 400e9, 400e9,
                 "NVIDIA H800 SXM5 product brief; DeepSeek-V3 technical report (2024)"),
    # NVIDIA H200 datasheet (2024), SXM: same tensor cores as H100; 141 GB HBM3e at 4.8 TB/s.
    "H200": _gpu("H200", 989.4 * T, 1978.9 * T, 494.7 * T, 66.9 * T, 141e9, 4.8e12, 900e9, 400e9,
                 "NVIDIA H200 SXM datasheet", fp64=66.9e12),
    # NVIDIA GH200 Grace Hopper Superchip datasheet (2023): H100-class GPU, BF16 1,979 / FP8 3,958
    # sparse; 96 GB HBM3 at 4 TB/s (144 GB HBM3e at 4.9 TB/s: GH200-144GB); NVLink 4 900 GB/s. The
    # node is a quad-GH200 blade (e.g. HPE Cray EX254n), one 400 Gb/s-class NIC per superchip.
    "GH200": _gpu("GH200", 989.4 * T, 1978.9 * T, 494.7 * T, 66.9 * T, 96e9, 4.0e12, 900e9, 400e9,
                  "NVIDIA GH200 Grace Hopper Superchip datasheet", gpus_per_node=4, fp64=66.9e12),
    "GH200-144GB": _gpu("GH200-144GB", 989.4 * T, 1978.9 * T, 494.7 * T, 66.9 * T, 144e9, 4.9e12, 900e9,
                        400e9, "NVIDIA GH200 Grace Hopper Superchip datasheet", gpus_per_node=4,
                        fp64=66.9e12),
    # NVIDIA A100 datasheet (2021), SXM4: BF16 312, TF32 156, FP32 19.5, FP64 tensor core 19.5 TFLOP/s;
    # 40 GB HBM2 at 1,555 GB/s or 80 GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s; HDR 200 Gb/s per GPU.
    "A100-40GB": _gpu("A100-40GB", 312 * T, 0, 156 * T, 19.5 * T, 40960 * MiB, 1.555e12, 600e9, 200e9,
                      "NVIDIA A100 SXM4 datasheet", attn=0.85, fp64=19.5 * T),
    "A100-80GB": _gpu("A100-80GB", 312 * T, 0, 156 * T, 19.5 * T, 81920 * MiB, 2.039e12, 600e9, 200e9,
                      "NVIDIA A100 SXM4 datasheet", attn=0.85, fp64=19.5 * T),
    # NVIDIA HGX B200 datasheet (2024), per GPU = board / 8, sparse halved: BF16 2.25 PFLOP/s, FP8 4.5,
    # TF32 1.125, FP64 40 TFLOP/s; 180 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s; 400 Gb/s NIC per GPU.
    "B200": _gpu("B200", 2.25 * P, 4.5 * P, 1.125 * P, 75 * T, 180e9, 8e12, 1.8e12, 400e9,
                 "NVIDIA HGX B200 datasheet (per GPU, dense)", fp64=40 * T),
    # NVIDIA GB200 NVL72 datasheet (2024), rack / 72, sparse halved: BF16 360 PF -> 2.5 PFLOP/s dense,
    # FP8 720 PF -> 5, TF32 180 PF -> 1.25, FP32 5,760 TF -> 80 TF; 13.4 TB HBM3e -> 186 GB at
    # 576 TB/s -> 8 TB/s; NVLink 5 130 TB/s -> 1.8 TB/s, one 72-GPU NVLink domain; 400 Gb/s NIC per GPU.
    "B200-NVL72": _gpu("B200-NVL72", 2.5 * P, 5 * P, 1.25 * P, 80 * T, 186e9, 8e12, 1.8e12, 400e9,
                       "NVIDIA GB200 NVL72 datasheet (per GPU, dense)", gpus_per_node=72),
    # AMD Instinct MI300X datasheet (2023): BF16 1,307.4, FP8 2,614.9, TF32 653.7, FP32 and FP64 matrix
    # 163.4 TFLOP/s; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links x 128 GB/s bidirectional.
    "MI300X": _gpu("MI300X", 1307.4 * T, 2614.9 * T, 653.7 * T, 163.4 * T, 192e9, 5.3e12, 7 * 128e9, 400e9,
                   "AMD Instinct MI300X datasheet", fp64=163.4 * T),
    # Google Cloud TPU v4 documentation: 275 TFLOP/s bf16 per chip (no fp8), 32 GiB HBM2 at
    # 1,200 GB/s, 4,096-chip pod; ICI: 6 links x 400 Gb/s per direction (Jouppi et al. 2023, TPU v4
    # ISCA paper) = 300 GB/s per direction per chip; DCN per chip assumed as v5p's 50 Gb/s.
    "TPUv4": _tpu("TPUv4", 275 * T, 0, 32 * GiB, 1.2e12, 600e9, 50e9, 4096,
                  "Google Cloud TPU v4 documentation; Jouppi et al. 2023"),
    # Google Cloud TPU v5p documentation: 459 TFLOP/s bf16 and 459 fp8 per chip, 95 GiB HBM at
    # 2,765 GB/s, ICI 1,200 GB/s bidirectional per chip, DCN 50 Gb/s per chip, slices up to 6,144 chips.
    "TPUv5p": _tpu("TPUv5p", 459 * T, 459 * T, 95 * GiB, 2.765e12, 1200e9, 50e9, 6144,
                   "Google Cloud TPU v5p documentation"),
    # A CPU "node": one process per core group, gloo over loopback within the node, 10 GbE across.
    "cpu": Accelerator("cpu", {"float32": 5e10, "bfloat16": 1e10, "float16": 5e9}, hbm_bytes=16 * GiB,
                       hbm_bytes_per_s=20e9, intra_node_bytes_per_s=2e9, inter_node_bytes_per_s=1.25e9,
                       intra_node_latency_s=20e-6, inter_node_latency_s=50e-6, gpus_per_node=2,
                       runtime_reserve_bytes=0.35 * GiB, allocator_overhead=1.0,
                       source="placeholder; `ndtrain plan --measure` measures peak and gloo bandwidth"),
}
# Other spellings; matched after lower-casing and dropping spaces, '-', '_' (so "TPU v4", "tpu-v4").
ALIASES = {"A100": "A100-80GB", "H100-80GB": "H100", "H100-SXM": "H100", "H100-SXM5": "H100",
           "H100-SXM-80GB": "H100", "H100-SXM-96GB": "H100-96GB",
           "H100-SXM5-96GB": "H100-96GB", "H100-NVL-94GB": "H100-NVL", "H100-NVL-96GB": "H100-NVL",
           "H800-SXM": "H800", "H200-SXM": "H200", "GH200-96GB": "GH200", "B200-HGX": "B200",
           "HGX-B200": "B200", "GB200": "B200-NVL72", "GB200-NVL72": "B200-NVL72", "MI300": "MI300X",
           "v4": "TPUv4", "TPU4": "TPUv4", "v5p": "TPUv5p", "TPU5p": "TPUv5p"}
