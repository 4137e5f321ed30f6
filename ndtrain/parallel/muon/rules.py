"""Rules of ``training.optimizer`` and the Muon keys (pure Python: ``ndtrain.config.validate``
calls ``check`` before any process starts)."""
from __future__ import annotations

from ndtrain.errors import ConfigError

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


def check_resume(saved: dict, t) -> None:
    """A checkpoint holds one optimizer's state (AdamW moments or Muon momenta, per group): raise
    ConfigError when ``training.optimizer`` (or, for Muon, the AdamW name patterns, which decide
    the groups) differs from ``saved`` (the run's saved ``training`` section; a missing key is the
    default)."""
    defaults = type(t)()
    keys = ("optimizer", "muon_adamw_patterns") if t.optimizer == "muon" else ("optimizer",)
    for key in keys:
        old, new = saved.get(key, getattr(defaults, key)), getattr(t, key)
        if old != new:
            raise ConfigError(f"training.{key} ({old!r} -> {new!r}) cannot change on resume: the checkpoints "
                              f"hold the other optimizer state; keep it, or use a new --run-dir")
