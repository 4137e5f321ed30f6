"""LoRA adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``), the
form ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the Hugging Face export of the
base model (``ndtrain convert --to-hf``).

Key names follow PEFT's saved layout: ``base_model.model.<HF module>.lora_A.weight`` (r, in) and
``.lora_B.weight`` (out, r), where ``<HF module>`` is the base weight's Hugging Face name without
``.weight`` (``model.layers.0.self_attn.q_proj``). The HF names come from the family exporter
(``ndtrain.hf.rules.EXPORTERS``) applied to the base state dict: a target weight must export as
one tensor unchanged (Llama-style projections do; stacked or permuted expert weights do not).
PEFT's scaling is ``lora_alpha / r``, the same as ``ndtrain.model.lora``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ndtrain.config import Config
from ndtrain.model.lora import is_adapter

PREFIX = "base_model.model."


def peft_state_dict(sd: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(PEFT adapter tensors, the adapted Hugging Face module names such as
    ``model.layers.0.self_attn.q_proj``: PEFT's ``target_modules``, matched as name suffixes) from a whole
    ndtrain state dict with adapters. Raises ValueError for an adapted weight the family exports
    changed (no one-to-one Hugging Face name)."""
    from ndtrain.hf.rules import EXPORTERS, export_family, export_problem

    problem = export_problem(cfg.model)
    if problem is not None:
        raise ValueError(problem)
    base = {k: v for k, v in sd.items() if not is_adapter(k)}
    hf_sd = EXPORTERS[export_family(cfg.model)][1](base, cfg.model)
    hf_of = {id(v): h for h, v in hf_sd.items()}  # the exporters rename, they do not copy
    out, short = {}, set()
    for k in sorted(sd):
        if not k.endswith(".lora_A"):
            continue
        mod = k[: -len(".lora_A")]
        hf = hf_of.get(id(base[mod + ".weight"]))
        if hf is None or not hf.endswith(".weight"):
            raise ValueError(f"{mod}: its weight does not export as one Hugging Face tensor, so its "
                             "adapter has no PEFT name")
        hf_mod = hf[: -len(".weight")]
        out[f"{PREFIX}{hf_mod}.lora_A.weight"] = sd[k].contiguous()
        out[f"{PREFIX}{hf_mod}.lora_B.weight"] = sd[mod + ".lora_B"].contiguous()
        short.add(hf_mod)
    return out, sorted(short)


def save_peft_folder(sd: dict[str, torch.Tensor], cfg: Config, folder: str | Path,
                     base_model: str = "") -> Path:
    """Write ``folder``/adapter_config.json and adapter_model.safetensors (float32) for the LoRA
    run ``cfg`` whose whole state dict is ``sd``; ``base_model``: the base's Hugging Face folder,
    recorded as ``base_model_name_or_path``. Returns the folder."""
    from safetensors.torch import save_file

    f = cfg.finetune
    tensors, targets = peft_state_dict(sd, cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": f.lora_rank, "lora_alpha": f.lora_alpha,
              "lora_dropout": f.lora_dropout, "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
              "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": base_model or None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().float().cpu() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return folder
