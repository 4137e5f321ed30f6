"""Hugging Face folders both ways: ``load_hf_checkpoint`` picks the model family by config.json's
``model_type``, ``save_hf_checkpoint`` by the model's options, and each family's module
(``llama``, ``moe`` for Mixtral / DeepSeek-V3, ``qwen3_moe``, ``qwen3_next``, ``mamba2``) maps the
config and the weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf.common import (
    DEFAULT_SHARD_BYTES,
    model_from_state_dict,
    read_safetensors,
    with_family_defaults,
    write_hf_folder,
)
from ndtrain.hf.llama import config_from_hf, state_dict_from_hf
from ndtrain.hf.mamba2 import config_from_hf_mamba2, state_dict_from_hf_mamba2
from ndtrain.hf.moe import config_from_hf_moe, state_dict_from_hf_moe
from ndtrain.hf.qwen3_moe import config_from_hf_qwen3_moe, state_dict_from_hf_qwen3_moe
from ndtrain.hf.qwen3_next import config_from_hf_qwen3_next, state_dict_from_hf_qwen3_next
from ndtrain.model import Transformer

# model_type -> (config.json dict -> ModelConfig, (HF state dict, cfg) -> ndtrain state dict)
_IMPORTERS = {"qwen3_moe": (config_from_hf_qwen3_moe, state_dict_from_hf_qwen3_moe),
              "mamba2": (config_from_hf_mamba2, state_dict_from_hf_mamba2),
              "qwen3_next": (config_from_hf_qwen3_next, state_dict_from_hf_qwen3_next)}


def load_hf_checkpoint(folder: str | Path, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Transformer]:
    """Read config.json and (possibly sharded) safetensors from ``folder`` into a ``Transformer``.
    The family comes from ``model_type`` (``_importer``).

    Returns (cfg, model) with parameters in ``dtype`` on ``device``.
    Raises FileNotFoundError, ValueError (unsupported config) or KeyError (missing weights).
    """
    folder = Path(folder)
    to_cfg, to_sd = _importer(json.loads((folder / "config.json").read_text()))
    cfg = to_cfg()
    return cfg, model_from_state_dict(cfg, to_sd(read_safetensors(folder), cfg), device, dtype)


def _importer(hf: dict):
    """The family of config.json dict ``hf`` as (() -> ModelConfig, (HF state dict, cfg) -> ndtrain
    state dict); the one place a folder's ``model_type`` picks its family."""
    if hf.get("model_type") in ("mixtral", "deepseek_v3"):  # ndtrain.hf.moe, with its family's defaults
        hf = with_family_defaults(hf)
        interleave = bool(hf.get("rope_interleave", True))
        return (lambda: config_from_hf_moe(hf)), (lambda sd, cfg: state_dict_from_hf_moe(sd, cfg, interleave))
    to_cfg, to_sd = _IMPORTERS.get(hf.get("model_type"), (config_from_hf, state_dict_from_hf))
    return (lambda: to_cfg(hf)), to_sd


def save_hf_checkpoint(model: Transformer, cfg: ModelConfig, folder: str | Path, tokenizer=None,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write a ``save_pretrained``-style folder loadable by ``AutoModelForCausalLM.from_pretrained``:
    safetensors (sharded past ``max_shard_bytes``), ``config.json``, ``generation_config.json`` and,
    given an ndtrain ``tokenizer``, its files for ``AutoTokenizer.from_pretrained`` (and its EOS /
    BOS ids in both configs). The family by the model's options (``ndtrain.hf.rules.export_family``):
    Llama for a dense MHA / GQA model, Mixtral / DeepSeek-V3 for an MoE / MLA one (``ndtrain.hf.moe``),
    Qwen3-MoE for a ``qk_norm`` one (``ndtrain.hf.qwen3_moe``), Mamba-2 for an all-``M`` mixer-only
    one (``ndtrain.hf.mamba2``), Qwen3-Next for Gated DeltaNet / gated attention
    (``ndtrain.hf.qwen3_next``). Raises ValueError, before writing anything, if the model fits none of
    them or uses an option its family's config.json cannot express (``ndtrain.hf.rules.export_problem``)."""
    from ndtrain.hf.rules import EXPORTERS, export_family, export_problem

    problem = export_problem(cfg)
    if problem is not None:
        raise ValueError(problem)
    to_cfg, to_sd = EXPORTERS[export_family(cfg)]
    sd = model.state_dict()
    dtype = next(iter(sd.values())).dtype
    hf_sd, hf_cfg = to_sd(sd, cfg), to_cfg(cfg, dtype)
    ids = None
    if tokenizer is not None:
        from ndtrain.data.tokenizer import save_tokenizer_files

        save_tokenizer_files(tokenizer, folder, cfg.max_seq_len)
        ids = (tokenizer.eos_id, tokenizer.bos_id)
    write_hf_folder(folder, hf_sd, hf_cfg, max_shard_bytes, *(ids or (None, None)))


def config_from_hf_folder(folder: str | Path) -> ModelConfig:
    """The ``ModelConfig`` that ``load_hf_checkpoint`` builds for ``folder``, from its config.json
    alone (no weights read). Raises FileNotFoundError, ValueError (a config it cannot express)."""
    return _importer(json.loads((Path(folder) / "config.json").read_text()))[0]()
