"""``ndtrain`` command line: ``train`` and ``plan`` (``bench``, ``convert``, ``generate`` follow).

    ndtrain train --config PRESET_OR_PATH [--nproc N] [--run-dir DIR] [--section.key=value ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ndtrain.config import ConfigError, load_config, parse_cli_overrides


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from ndtrain.launch import launch

    world = args.nproc if args.nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise ConfigError(f"--nproc ({world}) must be >= 1")
    cfg = load_config(args.config, parse_cli_overrides(extra), world_size=world)
    run_dir = Path(args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    launch(cfg, run_dir, args.nproc, announce=os.environ.get("RANK", "0") == "0")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ndtrain", description="N-D parallel transformer training")
    sub = parser.add_subparsers(dest="command", required=True)
    from ndtrain.config import CONFIG_DIR

    presets = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    tr = sub.add_parser(
        "train", help="train a model (extra --section.key=value args override the config)",
        description="Train a model. Any config key can be overridden as --section.key=value, e.g. "
                    "--training.steps=50 --parallel.tp=2 (sections: model, data, training, parallel, "
                    f"checkpoint, logging; see ndtrain/config.py). Presets: {presets}.")
    tr.add_argument("--config", default="default", help="preset name in configs/ or a YAML path")
    tr.add_argument("--nproc", type=int, default=None,
                    help="local processes to start (default: torchrun's WORLD_SIZE, else 1)")
    tr.add_argument("--run-dir", default=None, help="where metrics, checkpoints and plots go")
    try:
        from ndtrain.planner.cli import add_plan_parser

        add_plan_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a rank failed (its traceback once, then one line), 2 an invalid config
    or setup found before any process started (one line), 130 interrupted (Ctrl-C; all ranks
    stopped)."""
    from ndtrain.spawn import SpawnError  # torch-free: `ndtrain plan` must not import torch

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _train(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "plan":
            from ndtrain.planner.cli import run_plan

            return run_plan(args)
    except ConfigError as e:
        print(f"ndtrain: invalid config: {e}", file=sys.stderr)
        return 2
    except SpawnError as e:
        if e.details:
            print(e.details.rstrip(), file=sys.stderr)
        print(f"ndtrain: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ndtrain: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
