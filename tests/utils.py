"""What every test shares: one tiny configuration and one relative error.

Module level, so ranks spawned by ``tests.dist_utils.run_ranks`` import them too."""
from __future__ import annotations

import torch

from ndtrain.config import Config, apply_overrides, load_config, validate

# The parity tests' model and trainer: vocab 61 (tp 2 and 4 pad it), float64, clipping at 0.05.
TINY = {
    "model.vocab_size": 61, "model.dim": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.ffn_hidden": 48, "model.max_seq_len": 64, "data.seq_len": 16,
    "training.steps": 10, "training.dtype": "float64", "training.global_batch_size": 4,
    "training.micro_batch_size": 0, "training.lr": 1e-2, "training.warmup_steps": 2, "training.grad_clip": 0.05,
    "parallel.bucket_size_bytes": 4096,
}


def tiny_config(overrides: dict | None = None, *, world: int | None = None, preset: str = "debug",
                **sections: dict) -> Config:
    """``preset`` shrunk to ``TINY``, then ``overrides`` (``{"section.key": value}``) and ``sections``
    (``parallel={"tp": 2}``) on top, in that order. Validated against ``world`` ranks when given
    (ConfigError naming the rule)."""
    cfg = load_config(preset)
    flat = {**TINY, **(overrides or {})}
    for section, keys in sections.items():
        flat.update({f"{section}.{key}": value for key, value in keys.items()})
    apply_overrides(cfg, flat)
    if world is not None:
        validate(cfg, world)
    return cfg


def rel_err(a, b, norm: str = "max") -> float:
    """``|a - b| / |b|`` in the max norm, or ``norm="rms"`` (root mean square, in float64). 0 for an
    empty ``b`` (a ZeRO shard owning no rows); Python floats count as float64 scalars."""
    a, b = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64) for x in (a, b))
    if b.numel() == 0:
        return 0.0
    if norm == "rms":
        a, b = a.double(), b.double()
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()
    if norm != "max":
        raise ValueError(f"norm must be 'max' or 'rms', not {norm!r}")
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
