"""Where a run lives, and whether there is anything left to train in it.

The default run directory is stable, ``runs/<preset>`` (a preset name, or a YAML path's stem), so
running the same command again after an interruption resumes from the newest complete checkpoint
(``checkpoint.resume``, on by default; every preset checkpoints at about a tenth of its steps).

Re-running a run that already reached its end is not an error: the launcher prints one line
(``finished_message``) and exits 0 without starting any process. A checkpoint *past* the requested
end (``training.steps`` lowered below the checkpoint's step) is a config error (exit 2): that run
cannot honour the new schedule.
"""
from __future__ import annotations

import json
from pathlib import Path

from ndtrain.config import Config, ConfigError


def default_run_dir(config: str) -> Path:
    """``runs/<name>`` for a preset name or a YAML path (its stem), relative to the working dir."""
    return Path("runs") / Path(config).stem


def _end_step(run_dir: Path, end: int) -> int | None:
    """Step of the newest complete checkpoint, verified against its manifest only when that step
    decides something here (>= ``end``): then a damaged checkpoint is skipped as the resume would
    skip it (``ndtrain.checkpoint.integrity.verify``, read-only). Below ``end`` the launch goes ahead
    either way and the resume verifies, so the files are not read twice."""
    from ndtrain.checkpoint.dcp import complete_checkpoints
    from ndtrain.checkpoint.integrity import verify

    for path in reversed(complete_checkpoints(Path(run_dir) / "checkpoints")):
        try:
            step = int(json.loads((Path(path) / "meta.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            continue
        if step < end or verify(path) is None:
            return step
    return None


def finished_message(cfg: Config, run_dir: Path) -> str | None:
    """One line when ``run_dir``'s newest checkpoint already reached this job's end, else None.

    The end is ``training.stop_at_step`` when set, else ``training.steps``; only applies with
    ``checkpoint.resume`` (without it the run starts over). Raises ConfigError when the checkpoint
    is past ``training.steps``."""
    if not cfg.checkpoint.resume:
        return None
    t = cfg.training
    step = _end_step(run_dir, min(t.steps, t.stop_at_step) if t.stop_at_step else t.steps)
    if step is None:
        return None
    if step > t.steps:
        raise ConfigError(f"--run-dir {run_dir}: its newest checkpoint is at step {step}, past "
                          f"training.steps ({t.steps}); raise training.steps, or start a new run "
                          "(another --run-dir, or checkpoint.init_weights_from for its weights)")
    if step == t.steps:
        return (f"ndtrain: {run_dir} already finished (checkpoint at step {step} = training.steps); "
                "nothing to train. Raise --training.steps to continue, or pass another --run-dir")
    if t.stop_at_step and step >= t.stop_at_step:
        return (f"ndtrain: {run_dir} already reached training.stop_at_step ({t.stop_at_step}; "
                f"checkpoint at step {step}); raise or drop --training.stop_at_step to continue")
    return None
