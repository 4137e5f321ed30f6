"""The project's error types, in a module without imports so every layer can raise them (validate,
mesh and the rules modules raise ``ConfigError`` without importing ``config.load``, which validates)."""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the rule that failed."""


def require(ok: bool, msg: str) -> None:
    """Raise ``ConfigError(msg)`` unless ``ok``: the one-line form every layout rule uses."""
    if not ok:
        raise ConfigError(msg)


class StorageError(RuntimeError):
    """A write after launch failed (a full disk, a read-only or vanished mount). The message is one
    line naming the path and what was kept, e.g. "cannot write runs/x/checkpoints/step_00000040.tmp:
    No space left on device; the last good checkpoint step_00000030 is kept"."""
