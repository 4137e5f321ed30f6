"""Checkpoint integrity: a manifest of every file's size and CRC-32, written last, checked at load.

``save_checkpoint`` writes ``manifest.json`` into the ``.tmp`` folder after every rank's files are
on disk and before the atomic rename, so a complete folder always carries the checksums of what it
holds. ``verify`` re-reads each listed file and reports the first missing, truncated or corrupted
one; a file that appeared after the manifest (none should) is ignored.

CRC-32 (``zlib.crc32``, ISO 3309 / ITU-T V.42 polynomial) detects every burst error of up to 32 bits
and random corruption with probability 1 - 2^-32; it guards against torn writes and bit rot, not
against tampering (sha256 would, at several times the cost of reading the files). Only rank 0
computes and checks it, so a multi-node run needs the checkpoint folder on a shared file system
(which loading a DCP checkpoint of another layout needs anyway).
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK_BYTES = 1 << 22


class CheckpointUnusableError(RuntimeError):
    """A run directory holds checkpoints but none verifies; restarting cannot help, so the
    supervisor (``ndtrain.fault.supervisor``) never retries it."""


def file_crc32(path: Path) -> int:
    """CRC-32 of the whole file, read in 4 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: Path) -> dict:
    """Checksum every file under ``folder`` (recursively) into ``folder/manifest.json``; returns it.

    Written through a temporary name and renamed, so a manifest is never half written."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
    manifest = {"format": 1, "checksum": "crc32", "files": files}
    tmp = folder / (MANIFEST + ".part")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(folder / MANIFEST)
    return manifest


def verify(folder: Path) -> str | None:
    """None when every file the manifest lists is present with its size and CRC-32; otherwise the
    first problem in words (``"meta.json: missing"``, ``"__0_0.distcp: 812 bytes, manifest says
    4096 (truncated)"``, ``"...: checksum mismatch (corrupted)"``, ``"manifest.json: missing"``).

    A folder without a manifest (written before ndtrain wrote manifests) passes when its
    ``meta.json`` and DCP ``.metadata`` are there; only the newer format can prove its contents.
    """
    folder = Path(folder)
    mpath = folder / MANIFEST
    if not mpath.is_file():
        missing = [n for n in ("meta.json", ".metadata") if not (folder / n).is_file()]
        return f"{MANIFEST}: missing (and {', '.join(missing)} missing)" if missing else None
    try:
        files = json.loads(mpath.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST}: unreadable ({type(e).__name__})"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name}: missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            kind = "truncated" if size < want["bytes"] else "grown"
            return f"{name}: {size} bytes, manifest says {want['bytes']} ({kind})"
        if file_crc32(path) != want["crc32"]:
            return f"{name}: checksum mismatch (corrupted)"
    for required in ("meta.json", ".metadata"):
        if required not in files:
            return f"{required}: not in the manifest (incomplete checkpoint)"
    return None
