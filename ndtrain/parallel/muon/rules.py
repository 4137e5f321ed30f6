"""Rules of ``training.optimizer`` and the Muon keys (pure Python: ``ndtrain.config.validate``
calls ``check`` before any process starts)."""
from __future__ import annotations

from ndtrain.errors import ConfigError
from ndtrain.mixer_spec import layer_mixers

OPTIMIZERS = ("adamw", "muon")
SCALES = ("moonlight", "original")  # ndtrain.optim.muon.MUON_SCALES


def check(t) -> None:
    """Raise ConfigError naming the rule ``t`` (a ``TrainingConfig``) breaks."""
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError(f"training.optimizer ({t.optimizer}) must be one of {' | '.join(OPTIMIZERS)}")
    if t.muon_scale not in SCALES:
        raise ConfigError(f"training.muon_scale ({t.muon_scale}) must be one of {' | '.join(SCALES)}")
    if t.muon_ns_steps < 1:
        raise ConfigError(f"training.muon_ns_steps ({t.muon_ns_steps}) must be >= 1")
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"training.muon_momentum ({t.muon_momentum}) must be in [0, 1)")
    if t.muon_lr < 0:
        raise ConfigError(f"training.muon_lr ({t.muon_lr}) must be >= 0 (0 = training.lr)")


def check_model(cfg) -> None:
    """Raise ConfigError naming the rule that ``training.qk_clip`` or ``training.mup_base_width``
    breaks with the model and layout of ``cfg`` (a ``Config``)."""
    t, m = cfg.training, cfg.model
    if t.mup_base_width < 0:
        raise ConfigError(f"training.mup_base_width ({t.mup_base_width}) must be >= 0 (0 = off)")
    if t.qk_clip < 0:
        raise ConfigError(f"training.qk_clip ({t.qk_clip}) must be >= 0 (0 = off)")
    if not t.qk_clip:
        return
    if t.optimizer != "muon":
        raise ConfigError(f"training.qk_clip needs training.optimizer: muon (got {t.optimizer}): it is MuonClip's "
                          f"step")
    kinds = set(layer_mixers(m.layer_pattern, m.n_layers))
    if m.attention != "mha" and "attention" in kinds:
        raise ConfigError(f"training.qk_clip supports model.attention: mha only (got {m.attention}): MLA's "
                          f"shared RoPE key needs its own rule")
    if m.qk_norm:
        raise ConfigError("training.qk_clip with model.qk_norm: the norm undoes any scaling of wq / wk")
    if kinds & {"sliding_window", "dsa"}:
        raise ConfigError(f"training.qk_clip: layers {sorted(kinds & {'sliding_window', 'dsa'})} mask logits "
                          f"their own way; qk_clip records plain causal attention only")
    if "attention" not in kinds:
        raise ConfigError("training.qk_clip: the model has no softmax attention layer to clip")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"training.qk_clip needs parallel.cp 1 (got {cfg.parallel.cp}): a cp rank holds only "
                          f"its chunk's keys, so its logit maxima would miss the other chunks'")


def check_resume(saved: dict, t) -> None:
    """A checkpoint holds one optimizer's state (AdamW moments or Muon momenta, per group): raise
    ConfigError when ``training.optimizer`` (or, for Muon, the AdamW name patterns, which decide
    the groups) differs from ``saved`` (the run's saved ``training`` section; a missing key is the
    default)."""
    defaults = type(t)()
    keys = ("optimizer", "muon_adamw_patterns") if t.optimizer == "muon" else ("optimizer",)
    keys += ("mup_base_width",) if t.mup_base_width or saved.get("mup_base_width") else ()  # AdamW's groups
    for key in keys:
        old, new = saved.get(key, getattr(defaults, key)), getattr(t, key)
        if old != new:
            raise ConfigError(f"training.{key} ({old!r} -> {new!r}) cannot change on resume: the checkpoints "
                              f"hold the other optimizer state; keep it, or use a new --run-dir")
