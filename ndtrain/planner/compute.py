"""Compute time per operation: GEMMs by shape, FlashAttention, memory-bound ops at HBM bandwidth.

One microbatch's forward on one rank is a list of operations, each timed on its own:

* **GEMMs** (projections, SwiGLU, experts, output head; forward, input gradient, weight
  gradient): FLOPs 2MNK at ``peak x gemm_efficiency x shape factor``, bounded below by the HBM
  roofline (bytes of A, B and C once at ``hbm_efficiency`` x bandwidth; Williams et al. 2009).
  The shape factor is the tile occupancy of the output (M x N cut into the kernel's tiles; the
  padded tiles of the edges do no work) times the wave quantisation (``ceil(tiles / units)``
  waves of ``units`` SMs / CUs, the last one partly idle; NVIDIA's "Matrix Multiplication
  Background User's Guide", sections "Tile quantization" and "Wave quantization"). cuBLAS picks
  the tile per shape, so the best of a big and a small tile counts (the small one at a lower
  rate).
* **Attention** (FlashAttention, Dao et al. 2022 / Dao 2023 / Shah et al. 2024): the executed
  FLOPs (the causal half of the T x T pairs; forward 2 matmuls, backward 5 since it recomputes
  QK^T) at ``peak x attention_efficiency``, bounded below by reading Q, K, V, O (+ dO, dQ, dK, dV
  backward) once.
* **Memory-bound ops** (RMSNorm, RoPE, SwiGLU's product, residual adds, cross entropy, MoE
  permute / unpermute): bytes at ``hbm_efficiency`` x HBM bandwidth, per the layout's execution
  mode (``Layout.mode``: fused by ``compile``, several kernels each in ``eager``; ``exec_mode.py``).
  With sequence parallelism the norms and residuals see tokens / tp.

The per-generation constants (``GENERATIONS``; see docs/planner.md for the sources) are the only
efficiency numbers; the same ones serve every model, layout and published run of a generation.
``efficiency`` (``--efficiency``) replaces the model with v1's: every GEMM at that share of peak,
attention at it times ``Accelerator.attention_gemm_ratio``, memory-bound ops free (absorbed).
Units: seconds, FLOP/s, bytes, bytes/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ndtrain.planner import mixer_time
from ndtrain.planner.exec_mode import block_memory_seconds, loss_memory_seconds
from ndtrain.planner.hardware import COMPUTE_EFFICIENCY, HARDWARE, Cluster


@dataclass(frozen=True)
class ComputeConstants:
    """Efficiencies and GEMM geometry of one hardware generation (shares of datasheet peaks)."""

    generation: str
    gemm_efficiency: float  # large, tile-aligned 16-bit GEMMs at sustained clocks / dense peak
    attention_efficiency: float  # FlashAttention fwd+bwd, executed FLOPs / dense peak
    hbm_efficiency: float  # memory-bound kernels / HBM bandwidth
    units: int  # SMs / CUs / MXU cores a GEMM's tiles are spread over (0: no quantisation)
    tiles: tuple = ((256, 128, 1.0), (128, 128, 0.9))  # (tile M, tile N, rate relative to the big tile)
    source: str = ""


GENERATIONS = {
    "ampere": ComputeConstants("ampere", 0.60, 0.45, 0.80, 108, source=(
        "A100 SXM4: 108 SMs; cuBLAS 256x128 / 128x128 CTA tiles; FlashAttention-2 fwd+bwd 50-70% "
        "of peak alone (Dao 2023), lower inside a training step; STREAM-like copies ~80% of HBM")),
    "hopper": ComputeConstants("hopper", 0.58, 0.28, 0.85, 132, tiles=((128, 256, 1.0), (128, 128, 0.9)), source=(
        "H100 / H200 / H800 / GH200 SXM: 132 SMs; wgmma 128x256 tiles; FlashAttention-3 fwd 75%, "
        "bwd ~50% of peak alone (Shah et al. 2024), FlashAttention-2 35%")),
    "blackwell": ComputeConstants("blackwell", 0.60, 0.40, 0.85, 148, tiles=((256, 256, 1.0), (128, 256, 0.9)),
                                  source="B200: 148 SMs, 2-SM 256x256 tcgen05 tiles; Hopper's shares assumed"),
    "cdna3": ComputeConstants("cdna3", 0.45, 0.30, 0.80, 304, tiles=((256, 256, 1.0), (256, 128, 0.9)), source=(
        "MI300X: 304 CUs; hipBLASLt bf16 GEMMs reach ~45-55% of the 1,307 TFLOP/s datasheet peak "
        "(SemiAnalysis, MI300X vs H100 training benchmark, Dec 2024); CK FlashAttention ~30%")),
    "tpu_v4": ComputeConstants("tpu_v4", 0.65, 0.45, 0.85, 8, tiles=((128, 128, 1.0),), source=(
        "TPU v4: 2 TensorCores x 4 MXUs of 128x128 per chip (Jouppi et al. 2023); PaLM's 57.8% HFU "
        "on v4 (Chowdhery et al. 2022) bounds the GEMM share from below")),
    "tpu_v5p": ComputeConstants("tpu_v5p", 0.72, 0.45, 0.85, 8, tiles=((128, 128, 1.0),), source=(
        "TPU v5p: 2 TensorCores x 4 MXUs of 128x128 per chip; MaxText's published v5p dense runs "
        "(README, 2024) reach ~65-67% MFU, so large GEMMs sustain a larger share than on v4")),
}
# Every HARDWARE entry names its generation (a test walks the table); "flat" is the v1 model on
# purpose (cpu: its peak is measured by ``ndtrain plan --measure``, not a datasheet).
GENERATION_OF = {"A100-40GB": "ampere", "A100-80GB": "ampere", "H100": "hopper", "H100-96GB": "hopper",
                 "H100-NVL": "hopper", "H800": "hopper", "H200": "hopper", "GH200": "hopper",
                 "GH200-144GB": "hopper", "B200": "blackwell", "B200-NVL72": "blackwell", "MI300X": "cdna3",
                 "TPUv4": "tpu_v4", "TPUv5p": "tpu_v5p", "cpu": "flat"}
# float8 GEMMs: share of the FP8 peak relative to the 16-bit GEMMs' share of theirs (assumed: at
# LLM shapes public cuBLAS / Transformer Engine numbers give 1.6-1.8x over bf16, not the
# datasheet's 2x: full tensor-core load lowers clocks), and HBM bytes per bf16 element quantised
# (amax read 2, cast read 2, fp8 write 1, transposed fp8 write 1).
FP8_GEMM_SHARE = 0.85
FP8_CAST_BYTES = 6
FLAT_EFFICIENCY = COMPUTE_EFFICIENCY  # v1's one constant: accelerators without a generation entry (cpu, custom)


def compute_constants(acc, efficiency: float = 0.0) -> ComputeConstants | None:
    """The constants of ``acc``'s generation, or None for the flat model (``efficiency`` > 0, the
    "flat" generation, or a custom accelerator outside ``HARDWARE``, which run at
    ``FLAT_EFFICIENCY``). Raises KeyError for a ``HARDWARE`` entry without a generation."""
    if efficiency > 0:
        return None
    if acc.name in HARDWARE and acc.name not in GENERATION_OF:
        raise KeyError(f"accelerator {acc.name} has no compute generation (compute.GENERATION_OF)")
    gen = GENERATION_OF.get(acc.name, "flat")
    return None if gen == "flat" else GENERATIONS[gen]


def gemm_shape_factor(m: int, n: int, c: ComputeConstants) -> float:
    """Tile occupancy x wave quantisation of an (m x n) output, best over ``c.tiles`` (0..1]."""
    if c.units <= 0:
        return 1.0
    best = 0.0
    for tm, tn, rate in c.tiles:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / c.units)
        occupancy = m * n / (tiles * tm * tn)
        best = max(best, rate * occupancy * tiles / (waves * c.units))
    return best


def gemm_time(m: float, n: float, k: float, peak: float, hbm: float, c: ComputeConstants | None,
              el_bytes: int = 2, efficiency: float = FLAT_EFFICIENCY) -> float:
    """Seconds of one (m x k) @ (k x n) product: compute at the shape's efficiency, or the HBM
    roofline of reading both inputs and writing the output once, whichever is longer."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    if c is None:
        return flops / (peak * efficiency)
    rate = peak * c.gemm_efficiency * gemm_shape_factor(math.ceil(m), math.ceil(n), c)
    io = el_bytes * (m * k + k * n + m * n) / (hbm * c.hbm_efficiency)
    return max(flops / rate, io)


def gemm_fwd_bwd(m: float, n: float, k: float, peak: float, hbm: float, c, el_bytes: int = 2,
                 efficiency: float = FLAT_EFFICIENCY) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer y = x W, x (m, k), W (k, n): backward is the
    input gradient (m x n) @ (n x k) and the weight gradient (k x m) @ (m x n)."""
    f = gemm_time(m, n, k, peak, hbm, c, el_bytes, efficiency)
    b = gemm_time(m, k, n, peak, hbm, c, el_bytes, efficiency) + gemm_time(k, n, m, peak, hbm, c, el_bytes, efficiency)
    return f, b


@dataclass
class OpTimes:
    """Seconds of one microbatch on one rank by kind; ``fwd`` / ``bwd`` totals."""

    gemm_fwd: float = 0.0
    gemm_bwd: float = 0.0
    head_fwd: float = 0.0  # output head GEMMs (16-bit even under float8)
    head_bwd: float = 0.0
    attn_fwd: float = 0.0
    attn_bwd: float = 0.0
    mem_fwd: float = 0.0  # memory-bound ops
    mem_bwd: float = 0.0
    fp8_fwd: float = 0.0  # float8 casts and amax reductions of the quantised GEMMs' operands
    fp8_bwd: float = 0.0

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.head_fwd + self.attn_fwd + self.mem_fwd + self.fp8_fwd

    @property
    def bwd(self) -> float:
        return self.gemm_bwd + self.head_bwd + self.attn_bwd + self.mem_bwd + self.fp8_bwd


def attention_gemms(spec, tokens: float, tp: int) -> list[tuple[float, float, float, int]]:
    """(m, n, k, count) of one softmax attention's projections on one rank (TP splits n of the
    column-parallel q / k / v and k of the row-parallel output)."""
    h, a, D = spec.dim, spec.n_heads, spec.head_dim
    if spec.kv_lora_rank:  # MLA: the down / up projections as one h-wide GEMM, then the output
        v = spec.v_head_dim or D
        proj = spec.attn_params - h - a * v * h
        return [(tokens, proj / h / tp, h, 1), (tokens, h, a * v / tp, 1)]
    return [(tokens, (a + 2 * spec.n_kv_heads) * D / tp, h, 1), (tokens, h, a * D / tp, 1)]


def ffn_gemms(spec, tokens: float, tp: int, ep: int, moe: bool, etp: int = 0) -> list[tuple[float, float, float, int]]:
    """(m, n, k, count) of one block's SwiGLU / MoE GEMMs on one rank (EP: the rank's E / ep
    experts split etp ways (the experts' tp, 0: the attention tp), each fed tokens x (etp / tp) x
    top_k x ep / E rows: a folded mesh's expert-TP group takes etp / tp of the tp group's tokens)."""
    h = spec.dim
    if not moe:
        f = spec.ffn_hidden / tp
        return [(tokens, 2 * f, h, 1), (tokens, h, f, 1)] if f else []
    out = [(tokens, spec.n_experts, h, 1)]  # router (replicated)
    if spec.n_shared_experts:
        fs = spec.n_shared_experts * spec.shared_ffn_hidden / tp
        out += [(tokens, 2 * fs, h, 1), (tokens, h, fs, 1)]
    etp = etp or tp
    rows = tokens * etp / tp * spec.top_k * ep / spec.n_experts
    fe, local = spec.moe_ffn_hidden / etp, max(1, spec.n_experts // ep)
    return out + [(rows, 2 * fe, h, local), (rows, h, fe, local)]


def block_gemms(spec, tokens: float, tp: int, ep: int, moe: bool, etp: int = 0) -> list[tuple[float, float, float, int]]:
    """(m, n, k, count) of one softmax-attention block's forward GEMMs on one rank."""
    return attention_gemms(spec, tokens, tp) + ffn_gemms(spec, tokens, tp, ep, moe, etp)


def attention_times(spec, tokens: float, seq_len: int, tp: int, peak: float, hbm: float, c,
                    ratio: float, efficiency: float = FLAT_EFFICIENCY, e: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's FlashAttention core on one rank: ``tokens`` queries
    each attending to half of ``seq_len`` keys on average (causal); backward 2.5x the forward FLOPs."""
    fwd_flops = spec.attention_flops_per_layer(seq_len) / 6.0 * tokens / tp
    d_qk = spec.head_dim + (spec.qk_rope_head_dim if spec.kv_lora_rank else 0)
    d_v = (spec.v_head_dim or spec.head_dim) if spec.kv_lora_rank else spec.head_dim
    qkvo = tokens * e * spec.n_heads / tp * (2 * d_qk + 2 * d_v)  # q, k, v, o (kv heads <= heads)
    if c is None:
        rate = peak * efficiency * ratio
        return fwd_flops / rate, 2.5 * fwd_flops / rate
    rate = peak * c.attention_efficiency
    bw = hbm * c.hbm_efficiency
    return max(fwd_flops / rate, qkvo / bw), max(2.5 * fwd_flops / rate, 2 * qkvo / bw)


@dataclass(frozen=True)
class _Rates:
    """What one stage's operations run at: linear-layer / 16-bit peaks, HBM bandwidth (FLOP/s,
    bytes/s), the generation's constants (None: flat model at ``eff``), bytes per GEMM element."""

    lin: float
    hi: float
    hbm: float
    c: ComputeConstants | None
    eff: float
    fp8: bool

    @property
    def el(self) -> int:
        return 1 if self.fp8 else 2


def _add_linears(out: OpTimes, shapes, scale: float, r: _Rates) -> None:
    """``scale`` x the forward / backward GEMMs of ``shapes`` (m, n, k, count). Under float8 each
    GEMM runs at ``FP8_GEMM_SHARE`` of the FP8 peak's share and pays its quantisation: the input
    (m x k) and the weight (k x n) forward, the output gradient (m x n) backward, each read once
    for its amax (dynamic scaling), read again and written as fp8 plus its transpose (the wgrad's
    layout): ``FP8_CAST_BYTES`` per bf16 element, at HBM bandwidth (Micikevicius et al. 2022;
    Transformer Engine's cast-transpose kernels)."""
    lin = r.lin * FP8_GEMM_SHARE if r.fp8 else r.lin
    for m, n, k, times in shapes:
        f, b = gemm_fwd_bwd(m, n, k, lin, r.hbm, r.c, r.el, r.eff)
        out.gemm_fwd += scale * times * f
        out.gemm_bwd += scale * times * b
        if r.fp8 and r.c is not None:
            bw = r.hbm * r.c.hbm_efficiency
            out.fp8_fwd += scale * times * FP8_CAST_BYTES * (m * k + k * n) / bw
            out.fp8_bwd += scale * times * FP8_CAST_BYTES * m * n / bw


def stage_op_times(spec, cluster: Cluster, seq_len: int, lay, n_dense: int, n_moe: int, last: bool,
                   efficiency: float = 0.0, mixers: tuple | None = None) -> tuple[OpTimes, float]:
    """Seconds of one microbatch's forward and backward on one rank of a stage with ``n_dense`` +
    ``n_moe`` blocks (``last``: + output head, cross entropy and MTP modules), and the forward
    seconds of one softmax attention layer (what a CP ring exchange overlaps with). ``mixers``:
    ((kind, count), ...) of the stage's token mixers (``mixer_time.stage_mixers``; None: all
    softmax attention). Block GEMMs run at the compute dtype's peak (FP8 under float8, with its
    casts), the head, attention and the other mixers' cores at the 16-bit peak."""
    acc = cluster.accelerator
    c = compute_constants(acc, efficiency)
    eff = efficiency or FLAT_EFFICIENCY
    r = _Rates(cluster.peak_flops_per_s, cluster.mfu_peak_flops_per_s, acc.hbm_bytes_per_s, c, eff, cluster.is_fp8)
    tokens = lay.microbatch * seq_len / lay.cp
    out = OpTimes()
    for count, moe in ((n_dense, False), (n_moe, True)):
        if not count:
            continue
        _add_linears(out, ffn_gemms(spec, tokens, lay.tp, lay.ep, moe, lay.etp), count, r)
        if c is not None:
            f, b = block_memory_seconds(spec, tokens, lay.tp, lay.seq_parallel, moe, lay.mode, r.hbm * c.hbm_efficiency)
            out.mem_fwd += count * f
            out.mem_bwd += count * b
    mixers = mixers if mixers is not None else (("attention", n_dense + n_moe),)
    if last and spec.mtp_depth:
        mixers = tuple(mixers) + (("attention", spec.mtp_depth),)
    af, ab = attention_times(spec, tokens, seq_len, lay.tp, r.hi, r.hbm, c, acc.attention_gemm_ratio, eff)
    flat_rate = r.hi * eff * acc.attention_gemm_ratio
    for kind, count in mixers:
        if mixer_time.is_linear(kind):
            _add_linears(out, [mixer_time.mixer_projection(spec, kind, tokens, lay.tp)], count, r)
            f, b = mixer_time.linear_core_times(spec, kind, tokens, lay.tp, r.hi, r.hbm, c, flat_rate)
        else:
            _add_linears(out, attention_gemms(spec, tokens, lay.tp), count, r)
            f, b = (af, ab) if kind == "attention" else mixer_time.windowed_core_times(
                spec, kind, tokens, seq_len, lay.tp, r.hi, c, flat_rate)
        out.attn_fwd += count * f
        out.attn_bwd += count * b
    if last:
        _add_head(out, spec, tokens, lay, r)
    return out, af


def _add_head(out: OpTimes, spec, tokens, lay, r: _Rates) -> None:
    """Output head (x (1 + MTP depth), 16-bit), fused cross entropy over V / tp logits (read bf16,
    fp32 math; backward writes the logits' gradient), and the MTP modules' projection and block
    (their attention core is counted with the stage's mixers)."""
    passes, c = 1 + spec.mtp_depth, r.c
    f, b = gemm_fwd_bwd(tokens, spec.vocab_size / lay.tp, spec.dim, r.hi, r.hbm, c, 2, r.eff)
    out.head_fwd += passes * f
    out.head_bwd += passes * b
    if c is not None:
        ce_f, ce_b = loss_memory_seconds(tokens, spec.vocab_size / lay.tp, lay.mode, r.hbm * c.hbm_efficiency, passes)
        out.mem_fwd += ce_f
        out.mem_bwd += ce_b
    for _ in range(spec.mtp_depth):
        moe = spec.last_layer_is_moe
        shapes = [(tokens, spec.dim, 2 * spec.dim / lay.tp, 1)] + block_gemms(spec, tokens, lay.tp, lay.ep, moe, lay.etp)
        _add_linears(out, shapes, 1, r)
        if c is not None:
            f, b = block_memory_seconds(spec, tokens, lay.tp, lay.seq_parallel, moe, lay.mode, r.hbm * c.hbm_efficiency)
            out.mem_fwd += f
            out.mem_bwd += b


def optimizer_seconds(state_bytes: float, acc, efficiency: float = 0.0) -> float:
    """The optimizer step: reads and writes its local state once (``state_bytes`` moved) at HBM
    bandwidth x the generation's ``hbm_efficiency`` (1.0 under the flat model, as in v1)."""
    c = compute_constants(acc, efficiency)
    return state_bytes / (acc.hbm_bytes_per_s * (c.hbm_efficiency if c else 1.0))
