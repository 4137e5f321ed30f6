"""Typed run configuration: presets in ``configs/*.yaml``, dotted overrides, cross-field validation.

A config is a tree of dataclasses, one per section (``model``, ``data``, ``training``, ``parallel``,
``checkpoint``, ``logging``). Each field's comment documents it; units live in field names.
``load_config(preset, overrides)`` reads a preset (a name in ``configs/`` or a path), applies
``section.key=value`` overrides, and validates. Validation never needs a process group, so bad
layouts are rejected before any process starts; each error names the rule that failed.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from ndtrain.config.schema import Config  # the section types are exported by ndtrain.config
from ndtrain.config.validate import validate as _validate
from ndtrain.errors import ConfigError

# Presets ship inside the package (wheel package data); the repo's top-level configs/ links here.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def _coerce(value: Any, current: Any, key: str) -> Any:
    """Convert a YAML / CLI value to the type of the field's default."""
    if isinstance(current, str) and isinstance(value, (list, dict)):  # data.sources as YAML: kept as JSON
        return json.dumps(value)
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected a boolean, got {value!r}")
    try:
        if isinstance(current, int):
            if isinstance(value, str):
                value = float(value) if any(c in value for c in ".eE") else int(value)
            if float(value) != int(value):
                raise ValueError
            return int(value)
        if isinstance(current, float):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {type(current).__name__}, got {value!r}") from None
    return str(value)


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set ``section.key`` entries (values as YAML scalars or strings). Unknown keys are errors."""
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if len(parts) != 2:
            raise ConfigError(f"override {dotted!r}: keys have the form section.key")
        section, key = parts
        sec = getattr(cfg, section, None)
        if sec is None or not dataclasses.is_dataclass(sec):
            sections = [f.name for f in fields(cfg)]
            raise ConfigError(f"unknown config section {section!r} (in {dotted!r})"
                              f"{did_you_mean(section, sections, dotted.replace(section, '{}', 1))}")
        names = [f.name for f in fields(sec)]
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}"
                              f"{did_you_mean(key, names, section + '.{}')}; "
                              "`ndtrain config keys` lists every key")
        setattr(sec, key, _coerce(value, getattr(sec, key), dotted))
    return cfg


def did_you_mean(word: str, choices: list[str], template: str = "{}") -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` (difflib ratio >= 0.6), else ``""``.
    ``template`` formats the suggestion (e.g. ``"training.{}"`` to show the whole key)."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {template.format(close[0])!r}?)" if close else ""


def _flatten(tree: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    if tree is not None and not isinstance(tree, dict):
        raise ConfigError(f"a config file must be a mapping of sections (model:, training:, ...), "
                          f"not a {type(tree).__name__}")
    for section, values in (tree or {}).items():
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    return flat


def resolve_preset(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    named = CONFIG_DIR / f"{preset}.yaml"
    if named.exists():
        return named
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config {preset!r} is neither a file nor a preset{did_you_mean(path.stem, known)}; "
                      f"presets: {', '.join(known)}")


def parse_cli_overrides(args: list[str], flags: list[str] = ()) -> dict[str, str]:
    """``["--training.steps=50", "--data.seq_len", "64"]`` -> ``{"training.steps": "50", ...}``.
    ``flags``: the command's own options (``--nproc``...), suggested for a near miss.
    Raises ConfigError for an argument that is neither an override nor followed by a value."""
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            hint = did_you_mean(arg.split("=", 1)[0], list(flags))
            raise ConfigError(f"unexpected argument {arg!r}{hint}; overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value")
        out[key] = value
        i += 1
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (plain YAML keeps the last one
    silently, so a repeated section would hide an edit to the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(preset: str = "default", overrides: dict[str, Any] | None = None,
                world_size: int | None = None) -> Config:
    """Read a preset, apply overrides, validate (against ``world_size`` when given)."""
    cfg = Config()
    path = resolve_preset(preset)
    try:
        tree = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:  # one line naming file and line, not a parser traceback
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    apply_overrides(cfg, _flatten(tree))
    apply_overrides(cfg, overrides or {})
    validate(cfg, world_size)
    return cfg


def config_from_dict(tree: dict[str, Any]) -> Config:
    cfg = Config()
    apply_overrides(cfg, _flatten(tree))
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    Path(path).write_text(cfg.to_yaml())


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks (``ndtrain.config.validate``); raises ConfigError naming the failed rule.

    Runs once per launch: a config already validated for this ``world_size`` and unchanged since
    (``ndtrain train``: ``load_config`` validated it, then the launcher asks again) returns at once;
    any edit to a field, or another world size, validates again."""
    stamp = (world_size, dataclasses.astuple(cfg))
    if getattr(cfg, "_validated_for", None) == stamp:
        return
    _validate(cfg, world_size)
    cfg._validated_for = stamp  # not a dataclass field: never in to_dict / YAML / equality
