"""``ndtrain rehearse``: run one real training step of every rank role of a layout on this CPU, in a
fake world of the full size, and report its memory and traffic (docs/rehearsal.md).

    ndtrain rehearse --config PRESET --gpus N --hardware NAME [--moe-routing uniform|balanced|skewed:S]
        [--section.key=value ...] [--json]

Exit codes: 0 every role rehearsed, 1 a role failed (one line naming it), 2 an invalid layout
(``ConfigError``, before any process starts)."""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    """The ``rehearse`` subcommand on ``sub`` (argparse subparsers)."""
    rh = sub.add_parser(
        "rehearse", help="rehearse a layout at full size on this CPU (fake process group, fake tensors)",
        description="Run one real training step of each distinct rank role (pipeline stage) of the "
                    "layout the config names, at full model size, on a fake process group of --gpus "
                    "ranks and fake tensors; report peak memory by category and every collective per "
                    "mesh axis (docs/rehearsal.md). Extra --section.key=value args override the config.")
    rh.add_argument("--config", required=True, help="preset name in configs/ or a YAML path")
    rh.add_argument("--gpus", type=int, required=True, help="world size of the rehearsed job")
    rh.add_argument("--hardware", default="H100", help="planner accelerator whose memory the peak is held to")
    rh.add_argument("--warmup", type=int, default=1,
                    help="unmeasured steps before the measured one (1: Adam's state exists, as in a long run)")
    rh.add_argument("--moe-routing", default=None, metavar="ROUTING",
                    help="MoE models: the routing the dispatch is fed, uniform | balanced (both the "
                         "trainer's forced round-robin by position, training.moe_routing=balanced) | "
                         "skewed:S (the busiest ep rank gets S x the mean); default balanced; stated in the output")
    rh.add_argument("--json", action="store_true", help="print the result as JSON")


def run_rehearse(args, extra: list[str]) -> int:
    """``ndtrain rehearse``; raises ConfigError for an invalid layout (the caller prints it)."""
    from ndtrain.config import ConfigError, load_config, parse_cli_overrides
    from ndtrain.rehearsal.run import RehearsalError, rehearse

    if args.gpus < 1:
        raise ConfigError(f"--gpus ({args.gpus}) must be >= 1")
    if args.warmup < 0:
        raise ConfigError(f"--warmup ({args.warmup}) must be >= 0")
    over = parse_cli_overrides(extra)
    cfg = load_config(args.config, over, world_size=args.gpus)
    routing = _routing(args.moe_routing, cfg.model.is_moe, cfg.parallel.ep)
    if routing is not None:  # the dispatch's counts follow from the forced routing (rehearsal.routing)
        over = {**over, "training.moe_routing": "balanced"}
        cfg = load_config(args.config, over, world_size=args.gpus)
    try:
        from ndtrain.planner.hardware import get_accelerator

        get_accelerator(args.hardware)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    say = None if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
    try:
        res = rehearse(args.config, over, cfg, args.gpus, args.hardware, args.warmup, progress=say, routing=routing)
    except RehearsalError as e:
        print(f"ndtrain: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        from ndtrain.rehearsal.report import format_report

        print(format_report(res))
    return 0


def _routing(text: str | None, is_moe: bool, ep: int) -> str | None:
    """The ``--moe-routing`` of an MoE model (default ``balanced``), None for a dense one. Raises
    ConfigError: the flag on a dense model, a routing not modelled."""
    from ndtrain.config import ConfigError
    from ndtrain.rehearsal.routing import parse_routing

    if not is_moe:
        if text is not None:
            raise ConfigError(f"--moe-routing {text} needs an MoE model (model.moe_experts > 0)")
        return None
    try:
        parse_routing(text or "balanced", ep)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return text or "balanced"
