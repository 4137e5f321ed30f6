"""The project's error types, in a module with no imports so every layer can raise them.

``ConfigError`` lives here (re-exported by ``ndtrain.config.load``) so that ``ndtrain.config.validate``,
``ndtrain.mesh`` and the per-axis ``rules`` modules can raise it without importing ``ndtrain.config.load``,
which itself runs validation: no import cycle between config, validate and mesh.
"""
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
