"""Rotary position embedding (Su 2021, "RoFormer") with Llama 3.1 frequency scaling (Llama 3, 2024).

Rotate-half convention (Hugging Face / GPT-NeoX): dim i pairs with i + D/2. Meta's interleaved
layout differs by a fixed permutation of ``wq`` / ``wk`` rows, already carried by HF checkpoints,
so ``ndtrain.hf.llama`` copies them unchanged (Meta-format import is not provided). Tables are
computed as HF does (fp32), so imports match to float32 rounding."""
from __future__ import annotations

import math

import torch

from ndtrain.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """``theta^(-2i/D)``, i < D/2 (D = ``cfg.rope_dim``), (D/2,) float32 on CPU. Llama 3.1 scaling
    (``cfg.rope_scaling``, L = ``rope_original_max_seq_len``): wavelengths below L / high_freq_factor
    kept, above L / low_freq_factor divided by ``rope_scaling_factor``, linear in L / w between.
    Raises ValueError if the factors are inconsistent."""
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
    """(cos, sin) of ``position * inv_freq``, each (max_seq_len, D/2) float32 on ``device``."""
    inv_freq = rope_inv_freq(cfg)  # (D/2,)
    pos = torch.arange(cfg.max_seq_len, dtype=torch.int64, device="cpu").float()  # (S,)
    angles = pos[:, None] * inv_freq[None, :]  # (S, D/2)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (B, T, H, D) with cos / sin (T, D/2) or (B, T, D/2) at the tokens'
    positions (cast to x's dtype, as HF) -> (B, T, H, D). Partial RoPE (Qwen3-Next): tables covering
    R/2 < D/2 pairs rotate the first R dims only."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, D/2) or (B, T, 1, D/2)
    sin = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, H, D)
