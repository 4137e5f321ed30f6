"""Rotary position embedding (Su 2021, "RoFormer") with Llama 3.1 frequency scaling (Llama 3, 2024).

Convention: **rotate-half** (the Hugging Face / GPT-NeoX layout). Dim i of a head is paired with
dim i + D/2, and the pair is rotated by angle ``position * inv_freq[i]``. Meta's original
checkpoints use the interleaved layout (pairs (2i, 2i+1)); the two are equivalent up to a fixed
permutation of the rows of ``wq`` / ``wk``, which Hugging Face checkpoints already carry, so
``ndtrain.hf.llama`` copies q/k weights unchanged. Converting a Meta-format checkpoint would need that
permutation (not provided here).

Tables are computed exactly as Hugging Face computes them (fp32 inverse frequencies, fp32 angles
``pos * inv_freq``), so imported checkpoints match to float32 rounding.
"""
from __future__ import annotations

import math

import torch

from ndtrain.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/D)``, i = 0 .. D/2-1 (D = ``cfg.rope_dim``), with optional
    Llama 3.1 scaling.

    Llama 3.1 scaling (``cfg.rope_scaling``): with wavelength ``w = 2 pi / inv_freq`` and
    ``L = rope_original_max_seq_len``, frequencies whose wavelength is below ``L / high_freq_factor``
    are kept; those above ``L / low_freq_factor`` are divided by ``rope_scaling_factor``; those in
    between are interpolated linearly in ``L / w`` between the two.

    Returns: (D/2,) float32 on CPU. Raises ValueError if the scaling factors are inconsistent.
    """
    d = cfg.rope_dim  # head_dim, or MLA's decoupled RoPE slice
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))  # (D/2,)
    if not cfg.rope_scaling:
        return inv_freq
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    if not (hi > lo > 0 and factor > 0):
        raise ValueError(f"Llama 3.1 RoPE scaling needs high_freq_factor ({hi}) > low_freq_factor "
                         f"({lo}) > 0 and factor ({factor}) > 0")
    old_len = cfg.rope_original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq  # (D/2,)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)  # 0 at the low-frequency edge, 1 at the high one
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * inv_freq`` for positions 0 .. max_seq_len-1.

    Returns: (cos, sin), each (max_seq_len, D/2) float32 on ``device``.
    """
    inv_freq = rope_inv_freq(cfg)  # (D/2,)
    pos = torch.arange(cfg.max_seq_len, dtype=torch.int64, device="cpu").float()  # (S,)
    angles = pos[:, None] * inv_freq[None, :]  # (S, D/2)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of each head of ``x`` (rotate-half convention).

    Args:
        x: (B, T, H, D) queries or keys.
        cos, sin: (T, D/2) or (B, T, D/2), already gathered at the tokens' positions; cast to
            x's dtype here (as Hugging Face does).

    Returns: (B, T, H, D), dtype of x. Partial RoPE (Qwen3-Next, GPT-NeoX ``rotary_pct``): when
    cos / sin cover R/2 < D/2 pairs, the first R dims are rotated and the last D - R pass unchanged.
    """
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, D/2) or (B, T, 1, D/2)
    sin = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, H, D)
