"""A run directory as a self-contained artifact: what training writes into it and how the
after-training commands (``ndtrain generate | eval | convert``) read it back.

Contents (rank 0 writes the first three at start-up, ``write_run_files``):

    RUN_DIR/config.yaml          the resolved config (every key)
    RUN_DIR/tokenizer.json       the tokenizer (``"bytes"`` too, as an equivalent byte-level
                                 tokenizer), with tokenizer_config.json / special_tokens_map.json
    RUN_DIR/data_summary.json    ``ndtrain.data.summary.data_summary``
    RUN_DIR/checkpoints/step_XXXXXXXX/   DCP checkpoints, every tensor whole under its
                                 single-process name (``ndtrain.parallel.state``)

Because a checkpoint names tensors as one process's ``Transformer`` does, whatever layout wrote it
(TP, CP, PP, EP, ZeRO-3...), ``RunDir.load_model`` builds the plain single-process model and lets
DCP fill it. ``gather_model`` does the same from a live, parallelized trainer (the end-of-run
sample under any layout): the checkpoint adapter's whole tensors, one copy per pipeline stage, to
rank 0.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import Config, ConfigError, config_from_dict
from ndtrain.data.tokenizer import ByteTokenizer, Tokenizer, open_tokenizer, save_tokenizer_files


class RunDirError(ValueError):
    """A run directory or checkpoint the command cannot use; the message is one line for the user."""


def write_run_files(run_dir: Path, data, cfg: Config) -> None:
    """Rank 0, at start-up: the tokenizer files and ``data_summary.json`` (config.yaml is written
    by the trainer). ``data``: the prepared ``TokenData``. Raises ValueError (unreadable source)."""
    from ndtrain.data.summary import data_summary

    run_dir = Path(run_dir)
    save_tokenizer_files(data.tokenizer, run_dir, cfg.model.max_seq_len)
    (run_dir / "data_summary.json").write_text(json.dumps(data_summary(data, cfg), indent=2))


def load_state_into(model: nn.Module, path: Path, key: str = "checkpoint") -> None:
    """Fill ``model`` (a materialised single-process ``Transformer``) from the checkpoint at ``path``.

    The folder is verified against its manifest first (``ndtrain.checkpoint.dcp.require_verified``:
    every file's size and CRC-32), and the loaded weights must be finite. Names the checkpoint lacks
    are allowed only for a tied output head (a pipeline run stores it once, as the embedding).
    Raises RunDirError naming the damaged file, missing tensors, a shape mismatch or a non-finite
    tensor (one line; ``key`` names where ``path`` came from)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        ckpt.require_verified(path, key)
    except ckpt.CheckpointDamagedError as e:
        raise RunDirError(str(e)) from None
    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # DCP raises bare exceptions for missing / corrupt metadata
        raise RunDirError(f"{path}: unreadable checkpoint ({e})") from e
    template = model.state_dict()
    tied = {"output.weight"} if getattr(model.cfg, "tie_embeddings", False) else set()
    missing = [k for k in template if f"model.{k}" not in saved and k not in tied]
    if missing:
        raise RunDirError(f"{path} lacks {len(missing)} tensors of this model, e.g. {missing[:3]}: "
                          "a checkpoint of another model?")
    for k, v in template.items():
        meta = saved.get(f"model.{k}")
        if meta is not None and tuple(meta.size) != tuple(v.shape):
            raise RunDirError(f"{path}: {k} has shape {tuple(meta.size)}, the model {tuple(v.shape)}")
    try:
        ckpt.load_tensors(path, {"model": {k: v for k, v in template.items() if f"model.{k}" in saved}},
                          key, verified=True)
    except ckpt.CheckpointDamagedError as e:
        raise RunDirError(str(e)) from None
    if tied:
        model.tie_weights()
    bad = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise RunDirError(f"{key}={path}: the checkpoint is damaged ({len(bad)} tensors hold NaN / inf, "
                          f"e.g. {bad[0]})")


def build_empty_model(cfg: Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """A single-process ``Transformer`` of ``cfg.model`` with uninitialised weights (to be filled)
    and its RoPE tables built."""
    from ndtrain.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_rope()
    return model


@dataclass
class RunDir:
    """An opened run directory. ``RunDir.open(path)`` reads its config; RunDirError if unusable."""

    path: Path
    cfg: Config

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        path = Path(path)
        if not path.is_dir():
            raise RunDirError(f"--run-dir {path}: no such directory")
        conf = path / "config.yaml"
        if not conf.is_file():
            raise RunDirError(f"--run-dir {path}: no config.yaml (not an ndtrain run directory)")
        try:
            cfg = config_from_dict(yaml.safe_load(conf.read_text()) or {})
        except (yaml.YAMLError, ConfigError) as e:
            raise RunDirError(f"{conf}: unreadable ({str(e).splitlines()[0]})") from None
        return cls(path, cfg)

    def checkpoints(self) -> dict[int, Path]:
        """Complete checkpoints by step (``.tmp`` folders of an interrupted save are ignored)."""
        root = self.path / "checkpoints"
        if not root.is_dir():
            return {}
        found = (re.fullmatch(r"step_(\d{8})", p.name) for p in root.iterdir() if p.is_dir())
        return {int(m.group(1)): root / m.group(0) for m in found if m}

    def checkpoint(self, step: int | None = None) -> tuple[int, Path]:
        """(step, folder) of checkpoint ``step``, or of the newest when None. RunDirError if absent."""
        have = self.checkpoints()
        if not have:
            raise RunDirError(f"--run-dir {self.path}: no checkpoint under checkpoints/ (train with "
                              "--checkpoint.every=N to save some)")
        if step is None:
            step = max(have)
        if step not in have:
            raise RunDirError(f"--checkpoint {step}: not in {self.path / 'checkpoints'} "
                              f"(steps: {', '.join(map(str, sorted(have)))})")
        return step, have[step]

    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer from the directory alone (its ``tokenizer.json``); a ``"bytes"`` run
        gets the built-in ``ByteTokenizer``. RunDirError when the file is missing."""
        if self.cfg.data.tokenizer == "bytes":
            return ByteTokenizer()
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise RunDirError(f"--run-dir {self.path}: no tokenizer.json (a run of an older ndtrain?)")
        try:
            return open_tokenizer(str(path), self.cfg.model.vocab_size, self.cfg.data.eos_id)
        except ValueError as e:
            raise RunDirError(str(e)) from None

    def load_model(self, step: int | None = None, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, merge_lora: bool = True) -> tuple[nn.Module, int]:
        """(single-process ``Transformer`` in eval mode, its step) from checkpoint ``step`` (newest
        when None), whatever layout saved it. A LoRA run's adapters (``finetune.lora_rank``) are
        folded into the base weights unless ``merge_lora`` is False (then they stay attached,
        ``ndtrain.model.lora``). Raises RunDirError (no / incompatible checkpoint)."""
        step, path = self.checkpoint(step)
        model = build_empty_model(self.cfg, device, dtype)
        if self.cfg.finetune.lora_rank:
            from ndtrain.model import lora

            lora.apply_lora(model, self.cfg.finetune, self.cfg.training.seed)  # values come from the checkpoint
        load_state_into(model, path)
        if merge_lora:
            from ndtrain.model.lora import merge_lora as merge

            merge(model)
        return model.eval(), step


def _whole(value) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):  # ZeRO-3 / EP shards: collective over the DTensor's mesh
        value = value.full_tensor()
    return value.detach().to("cpu")


GATHER_LIMIT_BYTES = 8 * 2**30  # rank 0 holds the gathered copy in CPU memory: ~2B float32 weights


def sample_model(trainer, cfg: Config) -> tuple[nn.Module | None, str]:
    """(model rank 0 samples with, "") or (None, why not). The trainer's own model when rank 0 can
    run the forward alone; else ``gather_model`` (collective: every rank calls this) unless the
    weights exceed ``GATHER_LIMIT_BYTES`` (the same decision on every rank: it reads only ``cfg``)."""
    if not trainer.plan.sample_skip_reason:
        return trainer.model, ""
    from ndtrain.model import Transformer

    with torch.device("meta"):
        n_bytes = sum(p.numel() * 4 for p in Transformer(cfg.model).parameters())
    if n_bytes > GATHER_LIMIT_BYTES:
        return None, (f"{trainer.plan.sample_skip_reason}, and the weights ({n_bytes / 2**30:.0f} GiB) "
                      f"exceed what is gathered to one rank ({GATHER_LIMIT_BYTES / 2**30:.0f} GiB); "
                      "use `ndtrain generate` on a checkpoint")
    return gather_model(trainer, cfg), ""


def gather_model(trainer, cfg: Config) -> nn.Module | None:
    """Collective (every rank calls it): the trainer's weights as a single-process ``Transformer``
    on rank 0 (on the trainer's device, parameter dtype), None on the other ranks.

    Each rank takes its whole tensors through the layout's checkpoint path (tp gather, then the
    DTensor shards of ZeRO-3 / EP gathered); the first rank of each pipeline stage (data, context
    and tensor coordinates 0) sends its stage's tensors to rank 0. Rank 0 transiently holds one
    copy of the model in CPU memory."""
    from ndtrain.parallel.tp.state import gather_tp_state

    plan, mesh = trainer.plan, trainer.mesh
    state = gather_tp_state({"model": plan.grad_sync.model_state_dict()}, plan.model, mesh)["model"]
    whole = {k: _whole(v) for k, v in state.items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        lead = all(mesh.group(a).rank == 0 for a in ("dp", "cp", "tp"))
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(whole if lead else {}, parts, dst=0)
        if dist.get_rank() != 0:
            return None
        whole = {k: v for part in parts for k, v in part.items()}
    if cfg.finetune.lora_rank:  # the sampled model is the plain one with the adapters folded in
        from ndtrain.model.lora import merged_state

        whole = merged_state(whole, cfg.finetune.lora_alpha / cfg.finetune.lora_rank)
    model = build_empty_model(cfg, trainer.device, trainer.param_dtype)
    if cfg.model.tie_embeddings:
        whole.pop("output.weight", None)  # the same tensor as the embedding, stored by the last stage
        whole["output.weight"] = whole["tok_embeddings.weight"]
    model.load_state_dict(whole, strict=True)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def sample_text(trainer, data, cfg: Config, model=None) -> str:
    """Generate ``sample_tokens`` after ``sample_prompt`` with ``model`` (default: the trainer's, a
    ``train.trainer.Trainer``); the decoded prompt and continuation."""
    from ndtrain.inference.generate import generate

    model = model if model is not None else trainer.model
    tok = data.tokenizer
    ids = tok.encode(cfg.training.sample_prompt) or [tok.eos_id]
    prompt = torch.tensor(ids[-(cfg.model.max_seq_len - 1):], dtype=torch.long)
    gen = torch.Generator().manual_seed(cfg.training.seed)
    model.eval()
    ctx = (torch.autocast(trainer.device.type, dtype=trainer.autocast_dtype) if trainer.autocast
           else contextlib.nullcontext())
    with ctx:
        n_new = max(0, min(cfg.training.sample_tokens, cfg.model.max_seq_len - prompt.numel()))
        out = generate(model, prompt.to(trainer.device), n_new,
                       temperature=cfg.training.sample_temperature, top_k=cfg.training.sample_top_k,
                       generator=gen)
    trainer.model.train()
    return tok.decode(out.tolist())
