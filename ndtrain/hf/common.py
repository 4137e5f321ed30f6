"""What the Hugging Face importers / exporters share: a config.json's missing fields filled from
its family's ``transformers`` config class, RoPE fields, safetensors reading / writing, and building
a ``Transformer`` from a state dict."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.model import Transformer

# model_type -> the transformers config class whose defaults fill fields a config.json omits
CONFIG_CLASSES = {"llama": "LlamaConfig", "mixtral": "MixtralConfig", "deepseek_v3": "DeepseekV3Config",
                  "qwen3_moe": "Qwen3MoeConfig", "mamba2": "Mamba2Config", "qwen3_next": "Qwen3NextConfig"}


def with_family_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` plus, for every key it omits, the value ``transformers.<Family>Config(**hf)`` gives it
    (``MixtralConfig().rope_theta`` etc., read from the class: no table here), so an import sees what
    ``from_pretrained`` would, including values the class derives from others. Keys ``hf`` has win.

    Fallback, when ``transformers`` is not installed or lacks the family's class: nothing is filled
    in; the importer then raises ValueError naming each numeric field the config.json lacks (see
    ``require``), never substituting another family's value. Absent feature flags (biases, sliding
    window, head_dim, RoPE scaling; hidden_act = silu) still read as "off", which every family's class
    default agrees with. Raises ValueError when the class itself rejects ``hf``.
    """
    name = CONFIG_CLASSES.get(hf.get("model_type", "llama"))
    try:
        import transformers

        cls = getattr(transformers, name) if name else None
    except (ImportError, AttributeError):
        cls = None
    if cls is None:
        return dict(hf)
    try:
        full = cls(**hf).to_dict()
    except Exception as e:  # the class validates its fields; report it as an unsupported config
        raise ValueError(f"transformers.{name} rejects this config.json: {e}") from e
    return {**full, **hf}


def export_frame(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The HF names every Llama-family decoder export shares, from ndtrain's state dict ``sd``:
    embedding, final norm, the untied head (a tied head is left out) and each layer's two norms.
    The caller adds attention and feed-forward weights. Raises KeyError for a missing name."""
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(cfg.n_layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = sd[f"layers.{i}.attention_norm.weight"]
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = sd[f"layers.{i}.ffn_norm.weight"]
    return out


def unstack_experts(out: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], ff: str, moe: str,
                    names: dict[str, str], n_experts: int) -> None:
    """Write ndtrain's stacked expert weights ``{ff}.experts.{w}`` (E, out, in) into ``out`` as
    Hugging Face's per-expert ``{moe}.experts.{j}.{names[w]}.weight`` (out, in), j < ``n_experts``.
    Each slice is cloned: safetensors refuses tensors that share storage."""
    for n_name, h_name in names.items():
        stacked = sd[f"{ff}.experts.{n_name}"]
        for j in range(n_experts):
            out[f"{moe}.experts.{j}.{h_name}.weight"] = stacked[j].clone()


def require(hf: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Raise ValueError naming the ``keys`` missing from ``hf`` (only possible without transformers;
    see ``with_family_defaults``)."""
    missing = [k for k in keys if k not in hf]
    if missing:
        name = CONFIG_CLASSES.get(hf.get("model_type", "llama"), "its config class")
        raise ValueError(f"config.json lacks {missing}; install transformers to take the defaults of "
                         f"transformers.{name}, or write them into config.json")


def rope_params(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 4 or 5 config dict. Raises ValueError
    if neither ``rope_parameters.rope_theta`` nor ``rope_theta`` is present."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        require(hf, ("rope_theta",))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def rope_config(cfg: ModelConfig, scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """RoPE keys of an exported config.json: transformers 4 (``rope_theta``, ``rope_scaling``) and 5
    (``rope_parameters``)."""
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta)}


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


DEFAULT_SHARD_BYTES = 5 * 2**30  # save_pretrained's default max_shard_size ("5GB")


def shard_plan(hf_sd: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per safetensors file: in name order, a new file when the next tensor would push
    the current one past ``max_shard_bytes`` (a tensor larger than that gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(hf_sd):
        n = hf_sd[name].numel() * hf_sd[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_hf_folder(folder: str | Path, hf_sd: dict[str, torch.Tensor], hf_config: dict[str, Any],
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, eos_id: int | None = None,
                    bos_id: int | None = None) -> None:
    """Write the weights (tensors moved to CPU, contiguous) as ``model.safetensors``, or as
    ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` when they
    exceed ``max_shard_bytes`` (``save_pretrained``'s layout), ``config.json`` and
    ``generation_config.json`` (greedy; with ``eos_id`` also its EOS / pad ids and ``bos_id``,
    written into config.json too) to ``folder`` (created if needed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in list(folder.glob("model*.safetensors")) + list(folder.glob("model.safetensors.index.json")):
        old.unlink()  # a previous export's shards would otherwise be read with these
    sd = {k: v.detach().to("cpu").contiguous() for k, v in hf_sd.items()}
    plan = shard_plan(sd, max_shard_bytes)
    names = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    for file, keys in zip(names, plan):
        save_file({k: sd[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                 "weight_map": {k: f for f, keys in zip(names, plan) for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    gen: dict[str, Any] = {"do_sample": False}
    if eos_id is not None:
        ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
        hf_config = {**hf_config, **ids}
        gen.update(ids)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
