"""Corpus sources: ``DataConfig.source`` as a deterministic stream of text documents.

``"stdlib"``: the interpreter's standard-library ``.py`` files (no site-packages), by relative
path, one document each. Otherwise a path, glob (``**``) or comma-separated list; a directory means
every non-hidden file below it. ``.jsonl``: one document per line (field ``text_field``);
``.parquet``: one per non-null value of column ``text_field``; else UTF-8 text, one per file.
``max_corpus_bytes > 0`` cuts the stream at a character boundary. ``source_fingerprint`` hashes the
files and fields so caches follow corpus changes."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from ndtrain.config import DataConfig

_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> Path:
    """Directory of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """All ``.py`` files of the standard library, sorted by path relative to ``stdlib_root()``."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _expand_one(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        return sorted(files)
    if path.is_file():
        return [path]
    if glob.has_magic(spec):
        return sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)
                      if Path(p).is_file())
    return []


def resolve_files(cfg: DataConfig) -> list[Path]:
    """The files of ``cfg.source`` in reading order. Raises ValueError naming a path / glob that matched
    nothing."""
    if cfg.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"data.source='stdlib': no .py files found under {stdlib_root()}")
        return files
    specs = [s.strip() for s in cfg.source.split(",") if s.strip()]
    if not specs:
        raise ValueError(f"data.source ({cfg.source!r}) names no path")
    files: list[Path] = []
    seen: set[Path] = set()
    for spec in specs:
        matched = _expand_one(spec)
        if not matched:
            raise ValueError(f"data.source: {spec!r} matched no files")
        for p in matched:
            if p.resolve() not in seen:
                seen.add(p.resolve())
                files.append(p)
    return files


def _read_text(path: Path, errors: str = "strict") -> str:
    try:
        return path.read_text(encoding="utf-8", errors=errors)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read text file {path}: {e}") from e


def _iter_jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read JSONL file {path}: {e}") from e
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e})") from e
                if not isinstance(rec, dict) or field not in rec:
                    raise ValueError(f"{path}:{lineno}: record has no field {field!r} (data.text_field)")
                yield from _texts([rec[field]], f"{path}:{lineno}: field {field!r}")
        except UnicodeDecodeError as e:
            raise ValueError(f"cannot read JSONL file {path}: {e}") from e


def _texts(values, where: str) -> Iterator[str]:
    """The strings of ``values``, skipping nulls; ValueError naming ``where`` for a non-string."""
    for text in values:
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(f"{where} holds {type(text).__name__}, not a string")
        yield text


def _iter_parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for corrupt or missing files
        raise ValueError(f"cannot read parquet file {path}: {e}") from e
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"parquet file {path} has no column {field!r} (data.text_field); "
                         f"columns: {names}")
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        yield from _texts(batch.column(0).to_pylist(), f"parquet file {path}: column {field!r}")


def _iter_file(path: Path, cfg: DataConfig) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _iter_jsonl(path, cfg.text_field)
    elif suffix == ".parquet":
        yield from _iter_parquet(path, cfg.text_field)
    else:
        # The stdlib has a few deliberately mis-encoded test modules: replace, don't fail.
        yield _read_text(path, errors="replace" if cfg.source == "stdlib" else "strict")


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The non-empty documents of ``cfg.source`` in a fixed order, capped at ``cfg.max_corpus_bytes``.
    Raises ValueError (naming the path) when nothing matched, a record lacks ``text_field``, or a file
    cannot be read or decoded."""
    cap = cfg.max_corpus_bytes
    total = 0
    for path in resolve_files(cfg):
        for doc in _iter_file(path, cfg):
            if not doc:
                continue
            if cap > 0:
                data = doc.encode("utf-8")
                if total + len(data) >= cap:
                    doc = data[: cap - total].decode("utf-8", errors="ignore")
                    if doc:
                        yield doc
                    return
                total += len(data)
            yield doc


def source_fingerprint(cfg: DataConfig) -> str:
    """16-hex-char digest of the matched files (path, size, mtime) and ``source``, ``text_field``,
    ``max_corpus_bytes``. Raises ValueError as ``resolve_files``."""
    h = hashlib.sha256()
    h.update(json.dumps({"source": cfg.source, "text_field": cfg.text_field,
                         "max_corpus_bytes": cfg.max_corpus_bytes}, sort_keys=True).encode())
    for path in resolve_files(cfg):
        st = path.stat()
        h.update(f"\n{path.resolve()}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
