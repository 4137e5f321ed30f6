"""Every config key with its default and its documentation, read from ``ndtrain/config/schema.py``.

``ndtrain config keys`` prints this listing. The documentation of a field is the trailing comment
of its line in the schema source, so the listing cannot drift from the schema: there is no second
table to keep in step. ``ast`` finds the dataclasses and the line of each annotated field;
``tokenize`` finds the comment on that line (a ``#`` inside a string default is not a comment).
"""
from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

from ndtrain.config import schema
from ndtrain.config.schema import Config


@dataclass(frozen=True)
class ConfigKey:
    key: str  # "section.field"
    default: object  # the schema default (a preset may set another value)
    type_name: str  # "int", "float", "str", "bool"
    comment: str  # the field's trailing comment in schema.py ("" when it has none)


def _comments_by_line(source: str) -> dict[int, str]:
    """1-based line number -> text of the comment token on that line (without the ``#``)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _field_lines(source: str) -> dict[tuple[str, str], int]:
    """(class name, field name) -> line of the field's annotated assignment in the schema."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out[(node.name, stmt.target.id)] = stmt.end_lineno or stmt.lineno
    return out


def config_keys(schema_path: Path | None = None) -> list[ConfigKey]:
    """Every ``section.field`` of ``Config``, in schema order, with default, type and comment.

    ``schema_path`` defaults to the installed ``schema.py``; the defaults come from the
    dataclasses themselves (a ``default_factory`` is called)."""
    source = Path(schema_path or schema.__file__).read_text()
    comments, lines = _comments_by_line(source), _field_lines(source)
    keys = []
    for section in dataclasses.fields(Config):
        sec_obj = getattr(Config(), section.name)
        for f in dataclasses.fields(sec_obj):
            default = getattr(sec_obj, f.name)
            line = lines.get((type(sec_obj).__name__, f.name))
            keys.append(ConfigKey(f"{section.name}.{f.name}", default, type(default).__name__,
                                  comments.get(line, "") if line else ""))
    return keys


def format_keys(keys: list[ConfigKey], section: str | None = None) -> str:
    """Aligned text: ``key = default  # comment``, one key a line, a blank line between sections."""
    rows = [k for k in keys if section is None or k.key.split(".")[0] == section]
    width = max((len(f"{k.key} = {k.default!r}") for k in rows), default=0)
    out, last = [], None
    for k in rows:
        sec = k.key.split(".")[0]
        if last is not None and sec != last:
            out.append("")
        last = sec
        left = f"{k.key} = {k.default!r}"
        out.append(f"{left:<{width}}  # {k.comment}" if k.comment else left)
    return "\n".join(out)
