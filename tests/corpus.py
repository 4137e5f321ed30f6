"""Tiny training corpora for tests: real text from the standard library's own source.

The text depends only on the Python install, never on ndtrain's code, so a change to ndtrain does
not change the data a test trains on (a corpus cut from ``ndtrain/`` did: a test asserting that a
loss falls over a few steps then passed or failed with unrelated edits).
"""
from __future__ import annotations

import os
from pathlib import Path


def source_text(n_chars: int) -> str:
    """The first ``n_chars`` characters of the standard library's top-level ``*.py`` files, sorted
    by name and joined by newlines."""
    stdlib = Path(os.__file__).parent
    return "\n".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py")))[:n_chars]
