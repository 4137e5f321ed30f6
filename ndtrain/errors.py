"""The project's error types, in a module without imports so every layer can raise them (validate,
mesh and the rules modules raise ``ConfigError`` without importing ``config.load``, which validates)."""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the rule that failed."""


def require(ok: bool, msg: str) -> None:
    """Raise ``ConfigError(msg)`` unless ``ok``: the one-line form every layout rule uses."""
    if not ok:
        raise ConfigError(msg)
