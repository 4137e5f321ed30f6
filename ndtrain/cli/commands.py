"""``ndtrain`` command line: ``train``, ``plan``, ``config keys`` and ``--version``.

    ndtrain train --config PRESET_OR_PATH [--nproc N] [--run-dir DIR] [--print-config]
                  [--profile | --profile-steps A:B] [--section.key=value ...]
    ndtrain config keys [--section SECTION]
    ndtrain --version

``train`` writes to ``runs/<preset>`` unless ``--run-dir`` says otherwise, so the same command run
again resumes (``ndtrain.cli.rerun``); a run that already finished prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ndtrain.config import ConfigError, load_config, parse_cli_overrides
from ndtrain.errors import StorageError


def _train(args: argparse.Namespace, extra: list[str], flags: list[str] = ()) -> int:
    from ndtrain.cli.launch import launch

    world = args.nproc if args.nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise ConfigError(f"--nproc ({world}) must be >= 1")
    over = parse_cli_overrides(extra, flags)
    if args.profile_steps is not None:  # sugar for --logging.profile_steps (ndtrain.train.profiling)
        over["logging.profile_steps"] = args.profile_steps
    cfg = load_config(args.config, over, world_size=world)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from ndtrain.cli.rerun import default_run_dir

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    launch(cfg, run_dir, args.nproc, announce=os.environ.get("RANK", "0") == "0",
           max_restarts=args.max_restarts, elastic=args.elastic)
    return 0


def _config_cmd(args: argparse.Namespace) -> int:
    from ndtrain.config.keys import config_keys, format_keys

    keys = config_keys()
    sections = sorted({k.key.split(".")[0] for k in keys})
    if args.section and args.section not in sections:
        from ndtrain.config import did_you_mean

        raise ConfigError(f"unknown config section {args.section!r}{did_you_mean(args.section, sections)}; "
                          f"sections: {', '.join(sections)}")
    try:
        print(format_keys(keys, args.section), flush=True)
    except BrokenPipeError:  # `ndtrain config keys | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ndtrain import __version__

    parser = argparse.ArgumentParser(prog="ndtrain", description="N-D parallel transformer training")
    parser.add_argument("--version", action="version", version=f"ndtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from ndtrain.config import CONFIG_DIR

    presets = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    tr = sub.add_parser(
        "train", help="train a model (extra --section.key=value args override the config)",
        description="Train a model. Any config key can be overridden as --section.key=value, e.g. "
                    "--training.steps=50 --parallel.tp=2 (sections: model, data, training, parallel, "
                    f"checkpoint, logging; `ndtrain config keys` lists them). Presets: {presets}.")
    tr.add_argument("--config", default="default", help="preset name in configs/ or a YAML path")
    tr.add_argument("--nproc", type=int, default=None,
                    help="local processes to start (default: torchrun's WORLD_SIZE, else 1)")
    tr.add_argument("--run-dir", default=None,
                    help="where metrics, checkpoints and plots go (default runs/<preset>: re-running resumes)")
    tr.add_argument("--max-restarts", type=int, default=0,
                    help="restart all local ranks from the newest checkpoint after one dies, at most this "
                         "many times (events in RUN_DIR/events.jsonl; under torchrun use torchrun's flag)")
    tr.add_argument("--elastic", action="store_true",
                    help="with --max-restarts: when a rank is lost for good (RUN_DIR/elastic/lost_rank<r>, or "
                         "the same rank failing twice in a row), continue on the survivors in a layout the "
                         "planner picks, global batch kept (docs/fault_tolerance.md)")
    from ndtrain.train.profiling import DEFAULT_WINDOW

    tr.add_argument("--profile-steps", "--profile", dest="profile_steps", nargs="?", const=DEFAULT_WINDOW,
                    default=None, metavar="A:B",
                    help="write a torch.profiler Chrome trace of optimizer steps A..B (inclusive) to "
                         "RUN_DIR/profile/trace_steps_A-B_rank_R.json; --profile alone traces "
                         f"{DEFAULT_WINDOW} (= --logging.profile_steps=A:B)")
    tr.add_argument("--print-config", action="store_true",
                    help="print the resolved config (preset + overrides, validated) as YAML and exit")
    parser.train_flags = [o for a in tr._actions for o in a.option_strings]  # for "did you mean"
    cf = sub.add_parser("config", help="list every config key with its default and meaning")
    cf_sub = cf.add_subparsers(dest="config_command", required=True)
    keys = cf_sub.add_parser("keys", help="every key: section.key = default  # comment")
    keys.add_argument("--section", default=None, help="only this section (model, data, training, ...)")
    try:
        from ndtrain.cli.plan import add_plan_parser

        add_plan_parser(sub)
    except ImportError:
        pass
    from ndtrain.cli import after as cli_after  # generate / eval / convert

    cli_after.add_parsers(sub)
    from ndtrain.cli import data as cli_data  # data prepare

    cli_data.add_parser(sub)
    from ndtrain.rehearsal.command import add_parser as add_rehearse_parser  # ndtrain rehearse

    add_rehearse_parser(sub)
    return parser


def _rank_storage_error(e) -> str | None:
    """The message of a rank's StorageError (its traceback's last line), else None."""
    last = e.details.strip().splitlines()[-1] if e.details.strip() else ""
    name, _, message = last.partition(": ")
    return message if name.rsplit(".", 1)[-1] == StorageError.__name__ else None


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done (also: the run directory had already reached training.steps, said in one
    line), 1 a rank failed (its traceback once, then one line; a failed write after launch, such
    as a full disk: only its line, naming the path and the last good checkpoint), 2 an invalid
    config or setup found before any process started (one line; also a checkpoint past
    training.steps, or a run directory another training holds), 130 interrupted (Ctrl-C or
    SIGTERM; all ranks stopped)."""
    from ndtrain.cli.lock import RunDirInUse
    from ndtrain.spawn import SpawnError  # torch-free: `ndtrain plan` must not import torch

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            from ndtrain.fault.goodput import job_clock  # the job's wall time starts here

            with job_clock():
                return _train(args, extra, parser.train_flags)
        if args.command == "rehearse":  # extra args: --section.key=value overrides
            from ndtrain.rehearsal.command import run_rehearse

            return run_rehearse(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "config":
            return _config_cmd(args)
        if args.command in ("generate", "eval", "convert"):
            from ndtrain.cli.after import main as after_main

            return after_main(args)
        if args.command == "data":
            from ndtrain.cli.data import run as data_run

            return data_run(args)
        if args.command == "plan":
            from ndtrain.cli.plan import run_plan

            return run_plan(args)
    except RunDirInUse as e:  # a setup error, but not of the config
        print(f"ndtrain: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"ndtrain: invalid config: {e}", file=sys.stderr)
        return 2
    except StorageError as e:  # one process trained in this one
        print(f"ndtrain: {e}", file=sys.stderr)
        return 1
    except SpawnError as e:
        line = _rank_storage_error(e)
        if line:
            print(f"ndtrain: {line}", file=sys.stderr)
            return 1
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
