"""``RUN_DIR/events.jsonl``: one JSON object per line for each fault-tolerance event.

Each row has ``time`` (Unix seconds), ``kind`` (e.g. ``restart``, ``bad_step``, ``rollback``,
``checkpoint_corrupt``, ``collective_timeout``, ``straggler``) and the event's own fields (``rank``,
``step``, ``reason``, ...). Rows are appended with one ``write`` of a whole line and flushed, so a
process killed mid-run leaves at most a missing last line, never a torn one that breaks readers
(``read_events`` skips a line that does not parse).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


def log_event(run_dir: str | Path, kind: str, **fields: Any) -> dict:
    """Append one event to ``run_dir/events.jsonl`` and return the row written."""
    row = {"time": round(time.time(), 3), "kind": kind, **fields}
    path = Path(run_dir) / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
    return row


def read_events(run_dir: str | Path, kind: str | None = None) -> list[dict]:
    """The events of ``run_dir`` in order (only those of ``kind`` when given)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or row.get("kind") == kind:
            rows.append(row)
    return rows
