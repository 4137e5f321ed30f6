"""What the Hugging Face importers share: RoPE fields of a config.json, safetensors reading, and
building a ``Transformer`` from a state dict."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.model import Transformer


def rope_params(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 4 or 5 config dict."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(folder / f)))
    return sd


def model_from_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor], device="cpu",
                          dtype: torch.dtype = torch.float32) -> Transformer:
    """Build ``Transformer(cfg)`` on meta, materialise it on ``device`` in ``dtype`` and load ``sd``
    (strict: a missing or unexpected key raises RuntimeError); RoPE tables rebuilt in fp32."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.load_state_dict(sd, strict=True)
    model.init_rope()
    return model
