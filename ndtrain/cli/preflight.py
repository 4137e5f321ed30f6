"""Checks a run must pass before any process starts, each failing with one ConfigError line.

Layout rules live in ``ndtrain.config.validate``; these are the checks that look at this machine and the
file system, which a worker would otherwise hit after the ranks started, once per rank:

* the backend and device exist here (``nccl`` / ``training.device=cuda`` need CUDA);
* ``checkpoint.load_from`` and ``checkpoint.init_weights_from`` exist;
* the run directory can be written;
* the checkpoint that ``checkpoint.load_from`` / ``init_weights_from`` will start the run from holds
  this model's tensors in this model's shapes, read from the DCP metadata or the Hugging Face
  ``config.json`` without loading a weight (a fine-tune into a model of another shape is the usual
  mistake); the line names the first tensor that differs and the model keys behind it;
* a run directory that already holds checkpoints was trained with the same model and data: only
  training / parallel / checkpoint / logging keys may change on resume (a changed shape cannot load
  the checkpoint, changed data or tokenizer would silently train on other tokens). The run's
  ``config.yaml`` is therefore compared before anything overwrites it.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import yaml

from ndtrain.config import Config, ConfigError
from ndtrain.parallel.muon import rules as muon_rules

FROZEN_SECTIONS = ("model", "data")  # may not change once a run directory holds checkpoints
MOVABLE_KEYS = {"data.cache_dir"}  # where the cache lives, not what is in it


def preflight(cfg: Config, run_dir: Path, world: int) -> None:
    """Run every pre-start check for ``cfg`` trained in ``run_dir`` on ``world`` ranks.

    Raises ConfigError naming the key, path or rule that failed.
    """
    check_backend(cfg, world)
    check_checkpoint_paths(cfg)
    check_run_dir_writable(run_dir)
    check_resume_compatible(cfg, run_dir)
    check_start_checkpoint_shapes(cfg, run_dir)
    check_lora_targets(cfg)


def check_lora_targets(cfg: Config) -> None:
    """``finetune.lora_targets`` must each match a bias-free linear of the single-process model (built
    on the meta device), so that a typo stops the launch, not every rank after start-up."""
    if not cfg.finetune.lora_rank:
        return
    import torch

    from ndtrain.model import Transformer
    from ndtrain.model.lora import find_targets, is_plain_linear, parse_targets

    with torch.device("meta"):
        model = Transformer(cfg.model)
    try:
        find_targets(model, parse_targets(cfg.finetune.lora_targets), is_plain_linear)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def backend_for(cfg: Config) -> str:
    """The process-group backend: ``parallel.backend``, or for "auto" NCCL when training on CUDA, else gloo."""
    import torch

    if cfg.parallel.backend != "auto":
        return cfg.parallel.backend
    use_cuda = cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available())
    return "nccl" if use_cuda else "gloo"


def check_backend(cfg: Config, world: int) -> None:
    """``training.device=cuda`` and ``parallel.backend=nccl`` (several ranks) need CUDA here."""
    import torch

    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is available on this machine")
    if world > 1 and backend_for(cfg) == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("parallel.backend=nccl needs CUDA GPUs, but torch.cuda.is_available() is "
                              "False on this machine; use --parallel.backend=gloo (or auto)")
        if cfg.training.device == "cpu":
            raise ConfigError("parallel.backend=nccl cannot run with training.device=cpu; use gloo")


def check_checkpoint_paths(cfg: Config) -> None:
    """``checkpoint.load_from`` and ``checkpoint.init_weights_from`` (where the config has it), when
    set, must exist and be a checkpoint folder (``meta.json``) or, for ``init_weights_from``, a
    Hugging Face folder (``config.json``): every rank would otherwise fail on it after start-up."""
    for key in ("load_from", "init_weights_from"):
        src = getattr(cfg.checkpoint, key, "")
        if not src:
            continue
        path = Path(src)
        if not path.exists():
            raise ConfigError(f"checkpoint.{key}: {src} does not exist")
        hf_ok = key == "init_weights_from" and (path / "config.json").is_file()
        if not ((path / "meta.json").is_file() or hf_ok):
            what = "an ndtrain checkpoint folder (checkpoints/step_XXXXXXXX, with meta.json)"
            if key == "init_weights_from":
                what += " or a Hugging Face folder (with config.json)"
            raise ConfigError(f"checkpoint.{key}: {src} is not {what}")


def check_run_dir_writable(run_dir: Path) -> None:
    """The run directory, or the nearest folder above it that exists, accepts a new file.

    Probes by creating (and removing) a temporary file rather than asking ``os.access``, which
    says yes to root on read-only mounts; nothing is left behind when the check fails.
    """
    run_dir = Path(run_dir)
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: {probe} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(f"--run-dir {run_dir}: cannot write in {probe} ({e.strerror})") from None


def check_resume_compatible(cfg: Config, run_dir: Path) -> None:
    """A run directory with complete checkpoints keeps its model and data (``FROZEN_SECTIONS``).

    Compares ``cfg`` with the directory's ``config.yaml``; a key the saved file lacks (written by an
    older ndtrain) counts as its default, one this ndtrain no longer has is ignored. Raises ConfigError listing every differing key.
    """
    from ndtrain.checkpoint.dcp import latest_checkpoint

    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file() or latest_checkpoint(Path(run_dir) / "checkpoints") is None:
        return
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{saved_path}: unreadable ({e}); move it or use a new --run-dir") from None
    muon_rules.check_resume(saved.get("training") or {}, cfg.training)  # the optimizer state's kind
    changed = []
    for section in FROZEN_SECTIONS:
        now = getattr(cfg, section)
        defaults = dataclasses.asdict(type(now)())
        old = dict(defaults, **(saved.get(section) or {}))
        new = dataclasses.asdict(now)
        for key in new:
            name = f"{section}.{key}"
            if name not in MOVABLE_KEYS and old.get(key) != new.get(key):
                changed.append(f"{name} ({old.get(key)!r} -> {new.get(key)!r})")
    if changed:
        raise ConfigError(f"--run-dir {run_dir} holds checkpoints of another model / data; changed: "
                          f"{', '.join(changed)}. Model and data keys cannot change on resume: keep "
                          f"them, or use a new --run-dir")


def check_start_checkpoint_shapes(cfg: Config, run_dir: Path) -> None:
    """The checkpoint the run starts from, unless it resumes its own (``ndtrain.train.loop._start``:
    own > ``load_from`` > ``init_weights_from``), passes its manifest and has this model's tensors
    and shapes.

    Raises ConfigError naming the key, the first tensor (in the model's order) that is missing,
    extra or of another shape, and up to three model keys that differ from the checkpoint's config
    (its run's ``config.yaml`` or the Hugging Face ``config.json``) where one is found.
    """
    from ndtrain.checkpoint.dcp import latest_checkpoint

    c = cfg.checkpoint
    if c.resume and latest_checkpoint(Path(run_dir) / "checkpoints") is not None:
        return  # its own checkpoint wins; check_resume_compatible compared its model
    key = "load_from" if c.load_from else "init_weights_from" if getattr(c, "init_weights_from", "") else None
    if key is None:
        return
    path = Path(getattr(c, key))
    if (path / "meta.json").is_file():
        from ndtrain.checkpoint.integrity import verify

        if (problem := verify(path)) is not None:  # before launch: no rank starts, nothing is written
            raise ConfigError(f"checkpoint.{key}={path}: the checkpoint is damaged ({problem})")
        there, saved_model = _dcp_model_shapes(path, key), _run_model_config(path)
    else:  # a Hugging Face folder (check_checkpoint_paths allowed nothing else)
        from ndtrain.hf.folder import config_from_hf_folder

        try:
            saved_model = config_from_hf_folder(path)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"checkpoint.{key}: {path}/config.json: {str(e).splitlines()[0]}") from None
        there = _model_shapes(saved_model)
    problem = _first_difference(_model_shapes(cfg.model), there, cfg.model.tie_embeddings)
    if problem:
        raise ConfigError(f"checkpoint.{key}: {path} holds another model: {problem}"
                          f"{_config_difference(cfg.model, saved_model)}; set the model keys to the "
                          "checkpoint's, or start from another checkpoint")


def _model_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a single-process ``Transformer`` (built on the meta device:
    no memory), the names a checkpoint stores (``ndtrain.parallel.state``)."""
    import torch

    from ndtrain.model import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _dcp_model_shapes(path: Path, key: str) -> dict[str, tuple[int, ...]]:
    """The ``model.*`` tensors' global shapes in a DCP checkpoint's metadata (no tensor read)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - DCP raises bare exceptions for missing / corrupt metadata
        raise ConfigError(f"checkpoint.{key}: {path}: unreadable checkpoint metadata ({e})") from None
    return {k[len("model."):]: tuple(m.size) for k, m in saved.items()
            if k.startswith("model.") and hasattr(m, "size")}


def _first_difference(here: dict, there: dict, tied: bool) -> str | None:
    """The first tensor of this model (``here``) missing from or shaped otherwise in ``there``, else
    the first one ``there`` holds that this model lacks (deeper, or with parts this model has not:
    loading would silently drop it); None when they agree. Extra multi-token-prediction modules
    (``mtp.*``) are allowed: a training-only head that a fine-tune may leave out."""
    for name, shape in here.items():
        if name not in there:
            if tied and name == "output.weight":
                continue  # a tied head may be stored once, as the embedding
            return f"it has no {name} {shape}"
        if there[name] != shape:
            return f"{name} is {there[name]} there, {shape} in this model"
    extra = [n for n in there if n not in here and not n.startswith("mtp.")]
    return f"its {extra[0]} {there[extra[0]]} has no place in this model" if extra else None


def _run_model_config(path: Path):
    """The model config a checkpoint was trained with: ``config.yaml`` in the checkpoint folder
    (``ndtrain convert --from-hf``) or in its run directory (``RUN/checkpoints/step_N``); else None."""
    from ndtrain.config import config_from_dict

    for conf in (path / "config.yaml", path.parent.parent / "config.yaml"):
        if conf.is_file():
            try:
                return config_from_dict(yaml.safe_load(conf.read_text()) or {}).model
            except (yaml.YAMLError, ConfigError, TypeError, ValueError):
                return None
    return None


def _config_difference(now, saved) -> str:
    """``" (model.dim: 32 there, 64 here; ...)"`` for up to three differing model keys, or ""."""
    if saved is None:
        return ""
    old, new = dataclasses.asdict(saved), dataclasses.asdict(now)
    diff = [f"model.{k}: {old.get(k)!r} there, {v!r} here" for k, v in new.items() if old.get(k) != v]
    more = f"; +{len(diff) - 3} more" if len(diff) > 3 else ""
    return f" ({'; '.join(diff[:3])}{more})" if diff else ""
