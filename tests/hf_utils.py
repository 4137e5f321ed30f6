"""Checks the Hugging Face conversion tests share (Mamba-2, Qwen3-MoE, ...)."""
from __future__ import annotations

from pathlib import Path

import torch

from ndtrain.hf.common import read_safetensors
from ndtrain.hf.folder import load_hf_checkpoint, save_hf_checkpoint


def assert_hf_round_trip_exact(hf, folder: Path):
    """HF model ``hf`` saved, imported into ndtrain and exported again writes back the same tensor
    names and exactly the same values (a conversion is a relabelling and reshaping of weights, so
    any difference is a bug: tolerance 0). Returns the imported ndtrain ``ModelConfig``."""
    hf.save_pretrained(folder / "a")
    cfg, model = load_hf_checkpoint(folder / "a")
    save_hf_checkpoint(model, cfg, folder / "b")
    a, b = read_safetensors(folder / "a"), read_safetensors(folder / "b")
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0)
    return cfg


def assert_same_state(model: torch.nn.Module, back: torch.nn.Module) -> None:
    """Every tensor of ``model``'s state dict equals ``back``'s exactly (an export then import)."""
    for name, t in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], t, atol=0, rtol=0)
