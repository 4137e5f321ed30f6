"""``ndtrain convert`` both ways.

* ``to_hf``: a run directory's checkpoint (any layout: it stores whole tensors under single-process
  names) -> a Hugging Face folder (safetensors shards, config.json, generation_config.json,
  tokenizer files) that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load in one
  call; Llama, Mixtral, DeepSeek-V3, Qwen3-MoE, Mamba-2 or Qwen3-Next by the model
  (``ndtrain.hf.folder.save_hf_checkpoint``).
* ``from_hf``: a Hugging Face Llama / Mixtral / DeepSeek-V3 / Qwen3-MoE / Mamba-2 / Qwen3-Next
  folder (by its ``model_type``; ``ndtrain.hf.folder.load_hf_checkpoint``) -> an ndtrain checkpoint folder
  for ``checkpoint.init_weights_from`` (or ``load_from``-style inspection):

      OUT/meta.json            step 0, the source folder (what ``init_weights_from`` checks)
      OUT/<DCP files>          {"model": {name: whole tensor}} under the single-process names
      OUT/config.yaml          a full ndtrain config whose model section is the HF model's, and
                               whose data.tokenizer is OUT/tokenizer.json when the folder has one
      OUT/tokenizer.json (+ tokenizer_config.json)   copied from the HF folder, when present
      OUT/manifest.json        size and CRC-32 of every file (``ndtrain.checkpoint.integrity``)

  Written into ``OUT.tmp`` and renamed, so an interrupted conversion leaves no half checkpoint.
* ``merge_lora``: a LoRA run's checkpoint with the adapters folded into the base weights, as the
  same kind of checkpoint folder (``ndtrain convert --merge-lora RUN_DIR --out DIR``).
* ``to_peft``: a LoRA run's adapters alone as a PEFT folder (``ndtrain.hf.peft``).
"""
from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import torch

from ndtrain.checkpoint.integrity import write_manifest
from ndtrain.config import Config, save_config
from ndtrain.train.rundir import RunDir, RunDirError


def to_hf(run: RunDir, out_dir: str | Path, step: int | None = None,
          max_shard_bytes: int | None = None) -> int:
    """Export checkpoint ``step`` (newest when None) of ``run`` to ``out_dir`` in float32; returns
    the step. Raises RunDirError (no checkpoint / tokenizer) or ValueError (a model no HF family
    expresses, see ``ndtrain.hf.moe``)."""
    from ndtrain.hf.common import DEFAULT_SHARD_BYTES
    from ndtrain.hf.folder import save_hf_checkpoint

    model, step = run.load_model(step)
    save_hf_checkpoint(model, run.cfg.model, out_dir, run.tokenizer(), max_shard_bytes or DEFAULT_SHARD_BYTES)
    return step


def from_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the HF folder ``hf_dir`` into the ndtrain checkpoint folder ``out_dir`` (see the
    module docstring); returns ``out_dir``. Raises RunDirError when ``hf_dir`` has no config.json
    or ``out_dir`` exists, ValueError / KeyError for an unsupported model (``ndtrain.hf.folder``)."""
    from ndtrain.hf.folder import load_hf_checkpoint

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise RunDirError(f"--from-hf {hf_dir}: no config.json (not a Hugging Face model folder)")
    if out.exists():
        raise RunDirError(f"--out {out}: already exists; choose a new folder")
    model_cfg, model = load_hf_checkpoint(hf_dir, "cpu", torch.float32)
    cfg = Config(model=model_cfg)
    meta = {"step": 0, "converted_from": str(hf_dir.resolve()), "layout": {}}
    return _write_folder(model.state_dict(), cfg, out, meta, hf_dir)


def _write_folder(sd: dict, cfg: Config, out: Path, meta: dict, files_from: Path | None = None) -> Path:
    """The checkpoint folder of the module docstring: DCP ``{"model": sd}``, config.yaml, meta.json,
    the tokenizer files of ``files_from``, the manifest; written into ``OUT.tmp`` and renamed."""
    import torch.distributed.checkpoint as dcp

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with warnings.catch_warnings():  # one process without a process group is the intended use
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": sd}, checkpoint_id=str(tmp))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if files_from is not None and (files_from / name).is_file():
                shutil.copyfile(files_from / name, tmp / name)
        if (tmp / "tokenizer.json").is_file():
            cfg.data.tokenizer = str((out / "tokenizer.json").resolve())
        save_config(cfg, tmp / "config.yaml")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(tmp)  # every reader verifies it (checkpoint.init_weights_from too)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merge_lora(run: RunDir, out_dir: str | Path, step: int | None = None) -> tuple[Path, int]:
    """A LoRA run's checkpoint ``step`` (newest when None) with its adapters folded into the base
    weights (W + alpha / r * B A, float32), written as an ndtrain checkpoint folder (the layout of
    the module docstring, ``finetune.lora_rank`` 0 in its config.yaml) for
    ``checkpoint.init_weights_from`` / ``ndtrain generate``. Returns (folder, step). Raises
    RunDirError when the run has no adapters or ``out_dir`` exists."""
    out = Path(out_dir)
    if not run.cfg.finetune.lora_rank:
        raise RunDirError(f"--merge-lora {run.path}: not a LoRA run (finetune.lora_rank is 0)")
    if out.exists():
        raise RunDirError(f"--out {out}: already exists; choose a new folder")
    model, step = run.load_model(step)  # merged
    cfg = copy.deepcopy(run.cfg)
    cfg.finetune.lora_rank = 0
    meta = {"step": 0, "converted_from": str(Path(run.path).resolve()), "merged_lora_step": step, "layout": {}}
    return _write_folder(model.state_dict(), cfg, out, meta), step


def to_peft(run: RunDir, out_dir: str | Path, step: int | None = None) -> int:
    """A LoRA run's adapters at checkpoint ``step`` (newest when None) as a PEFT folder
    (``ndtrain.hf.peft``) for the base model's Hugging Face export; returns the step. Raises
    RunDirError for a run without adapters, ValueError for a model PEFT names cannot express."""
    from ndtrain.hf.peft import save_peft_folder

    if not run.cfg.finetune.lora_rank:
        raise RunDirError(f"--to-peft: {run.path} is not a LoRA run (finetune.lora_rank is 0)")
    model, step = run.load_model(step, merge_lora=False)
    src = Path(run.cfg.checkpoint.init_weights_from) if run.cfg.checkpoint.init_weights_from else None
    hf_base = str(src.resolve()) if src is not None and (src / "config.json").is_file() else ""
    save_peft_folder(model.state_dict(), run.cfg, out_dir, hf_base)
    return step
