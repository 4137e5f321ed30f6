"""The after-training commands of ``ndtrain``: ``generate``, ``eval``, ``convert``.

    ndtrain generate --run-dir D [--checkpoint STEP] [--prompt TEXT | --prompt-file F]
                     [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
    ndtrain eval     --run-dir D [--checkpoint STEP] [--data SOURCE] [--batches N] [--json PATH]
    ndtrain eval     --tasks FILE [--tasks FILE ...] [--details] [--json PATH] RUN_DIR
    ndtrain convert  --run-dir D [--checkpoint STEP] --to-hf OUT_DIR
    ndtrain convert  --from-hf HF_DIR --out CKPT_DIR
    ndtrain convert  --merge-lora RUN_DIR --out CKPT_DIR     (LoRA adapters folded into the base)
    ndtrain convert  --run-dir D --to-peft OUT_DIR          (LoRA adapters as a PEFT folder)

Every command works from the run directory alone (``ndtrain.train.rundir``) and on one process, whatever
layout trained the checkpoint. ``main`` returns the exit code: 0 done, 2 a user error (no run
directory, no checkpoint, a bad path or flag), printed as one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMANDS = ("generate", "eval", "convert")


def add_parsers(sub) -> None:
    """Register the three subcommands on ``sub`` (``ArgumentParser.add_subparsers()``)."""
    g = sub.add_parser("generate", help="generate text from a run's checkpoint (streams to stdout)",
                       description="Generate text from a run directory's checkpoint, any layout. "
                                   "Sampling defaults come from the run's training.sample_* keys; "
                                   "generation stops at the EOS token or after --max-new-tokens.")
    _common(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: training.sample_prompt)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    g.add_argument("--max-new-tokens", type=int, default=None, help="default: training.sample_tokens")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the run's)")
    g.add_argument("--top-k", type=int, default=None, help="0 = off (default: the run's)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: training.seed)")
    e = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run's checkpoint, or task "
                                    "accuracy (JSON)",
                       description="Evaluate a checkpoint on the run's validation split or on --data "
                                   "(formulas: ndtrain/inference/evaluate.py), or on --tasks files "
                                   "(ndtrain/inference/tasks.py); prints JSON.")
    _common(e, required=False)
    e.add_argument("run_dir_pos", nargs="?", default=None, metavar="RUN_DIR", help="the run directory "
                                                                                  "(or --run-dir)")
    e.add_argument("--tasks", action="append", default=None, metavar="FILE",
                   help="JSONL task file (multiple choice or generation); repeat or comma-separate")
    e.add_argument("--details", action="store_true", help="with --tasks: per-example results in the JSON")
    e.add_argument("--data", default=None, help="corpus to evaluate (as data.source); default: the "
                                                "run's held-out validation split")
    e.add_argument("--batches", type=int, default=None,
                   help="batches of training.global_batch_size sequences (default: every sequence once)")
    e.add_argument("--json", default=None, help="also write the result to this file")
    c = sub.add_parser("convert", help="ndtrain checkpoint <-> Hugging Face folder",
                       description="--run-dir D --to-hf OUT: export a checkpoint (any layout) to a "
                                   "Hugging Face folder; --from-hf HF_DIR --out CKPT: import one as "
                                   "an ndtrain checkpoint for checkpoint.init_weights_from.")
    c.add_argument("--run-dir", default=None, help="run directory to export from")
    c.add_argument("--checkpoint", type=int, default=None, help="step to export (default: newest)")
    c.add_argument("--to-hf", default=None, help="output Hugging Face folder")
    c.add_argument("--max-shard-bytes", type=int, default=None, help="safetensors shard size (default 5 GiB)")
    c.add_argument("--from-hf", default=None, help="Hugging Face folder to import")
    c.add_argument("--out", default=None, help="output ndtrain checkpoint folder (for --from-hf, --merge-lora)")
    c.add_argument("--merge-lora", default=None, metavar="RUN_DIR",
                   help="a LoRA run: fold its adapters into the base weights, write an ndtrain checkpoint to --out")
    c.add_argument("--to-peft", default=None, help="a LoRA run's adapters as a PEFT folder (with --run-dir)")


def _common(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--run-dir", required=required, help="the run directory (config.yaml, checkpoints/)")
    p.add_argument("--checkpoint", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the float32 model runs (auto: cuda when available)")


def _device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        _usage("--device cuda: no CUDA device on this machine")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def main(args: argparse.Namespace) -> int:
    """Run the parsed command; user errors are one line on stderr and exit code 2."""
    from ndtrain.train.rundir import RunDirError

    runner = {"generate": _generate, "eval": _eval, "convert": _convert}[args.command]
    try:
        return runner(args)
    except (RunDirError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"ndtrain {args.command}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    except Exception as e:  # a read-only or full --to-hf / --out / --json target: one line, exit 1
        from ndtrain.train.outputs import write_failure

        target = args.to_hf or args.out or args.to_peft if args.command == "convert" else getattr(args, "json", None)
        kept = "the result is printed above" if args.command == "eval" else "the source is unchanged"
        line = write_failure(e, target or "?", kept)
        if line is None:
            raise
        print(f"ndtrain {args.command}: {line}", file=sys.stderr)
        return 1


def _usage(msg: str) -> None:
    from ndtrain.train.rundir import RunDirError

    raise RunDirError(msg)


def _generate(args) -> int:
    import torch

    from ndtrain.inference.generate import TextStream, stream_tokens
    from ndtrain.train.rundir import RunDir

    run = RunDir.open(args.run_dir)
    t = run.cfg.training
    if args.prompt_file is not None:
        if not Path(args.prompt_file).is_file():
            _usage(f"--prompt-file {args.prompt_file}: no such file")
        prompt = Path(args.prompt_file).read_text(encoding="utf-8")
    else:
        prompt = t.sample_prompt if args.prompt is None else args.prompt
    model, _ = run.load_model(args.checkpoint, _device(args.device))
    tok = run.tokenizer()
    ids = tok.encode(prompt) or [tok.eos_id]
    n_new = t.sample_tokens if args.max_new_tokens is None else args.max_new_tokens
    if n_new < 0:
        _usage(f"--max-new-tokens ({n_new}) must be >= 0")
    if len(ids) + n_new > run.cfg.model.max_seq_len:
        _usage(f"prompt ({len(ids)} tokens) + --max-new-tokens ({n_new}) exceeds the model's "
               f"max_seq_len ({run.cfg.model.max_seq_len})")
    gen = torch.Generator().manual_seed(t.seed if args.seed is None else args.seed)
    tokens = stream_tokens(model, torch.tensor(ids), n_new,
                           t.sample_temperature if args.temperature is None else args.temperature,
                           t.sample_top_k if args.top_k is None else args.top_k, gen,
                           top_p=args.top_p, stop_ids=(tok.eos_id,))
    stream = TextStream(tok.decode, ids)
    sys.stdout.write(prompt)
    for tid in tokens:
        sys.stdout.write(stream.push(tid))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    return 0


def _eval(args) -> int:
    from ndtrain.inference.evaluate import evaluate, stream_byte_counts, stream_tokens_of
    from ndtrain.train.rundir import RunDir

    if args.run_dir_pos is not None and args.run_dir not in (None, args.run_dir_pos):
        _usage(f"two run directories: --run-dir {args.run_dir} and {args.run_dir_pos}")
    args.run_dir = args.run_dir or args.run_dir_pos
    if args.run_dir is None:
        _usage("give the run directory (RUN_DIR or --run-dir D)")
    if args.tasks:
        return _eval_tasks(args)
    if args.details:
        _usage("--details goes with --tasks")
    run = RunDir.open(args.run_dir)
    cfg = run.cfg
    if args.batches is not None and args.batches < 1:
        _usage(f"--batches ({args.batches}) must be >= 1")
    model, step = run.load_model(args.checkpoint, _device(args.device))
    tok = run.tokenizer()
    T, G = cfg.data.seq_len, cfg.training.global_batch_size
    if args.data is None:
        from ndtrain.data import TokenData, prepare_data

        tokens = TokenData(prepare_data(cfg.data, cfg.model.vocab_size)).tokens("val")
        what = "validation split"
    else:
        need = args.batches * G * T + 1 if args.batches else 0
        tokens = stream_tokens_of(args.data, cfg.data, tok, need)
        what = args.data
    used = min(len(tokens), (args.batches * G if args.batches else len(tokens)) * T + 1)  # positions read
    counts = stream_byte_counts(tok, tokens[:used], cfg.model.vocab_size)
    out = {"checkpoint_step": step, "data": what, "seq_len": T,
           **evaluate(model, tokens, T, G, counts, args.batches)}
    _print_json(out, args.json)
    return 0


def _eval_tasks(args) -> int:
    from ndtrain.inference.tasks import load_task, run_task
    from ndtrain.train.rundir import RunDir

    if args.data is not None or args.batches is not None:
        _usage("--tasks scores task files; --data / --batches evaluate a corpus (give one or the other)")
    tasks = [load_task(f) for spec in args.tasks for f in spec.split(",") if f]  # checked before loading
    names = [t.name for t in tasks]
    if len(set(names)) < len(names):
        _usage(f"--tasks: two task files share a name (the file stem): {names}")
    run = RunDir.open(args.run_dir)
    model, step = run.load_model(args.checkpoint, _device(args.device))
    tok = run.tokenizer()
    out = {"checkpoint_step": step, "tasks": {t.name: run_task(model, tok, t, args.details) for t in tasks}}
    _print_json(out, args.json)
    return 0


def _print_json(out: dict, path: str | None) -> None:
    text = json.dumps(out, indent=1)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


def _convert(args) -> int:
    from ndtrain.cli.convert import from_hf, to_hf
    from ndtrain.train.rundir import RunDir

    if args.merge_lora is not None or args.to_peft is not None:
        return _convert_lora(args)
    if args.from_hf is not None:
        if args.out is None or args.run_dir is not None or args.to_hf is not None:
            _usage("--from-hf HF_DIR needs --out CKPT_DIR (and no --run-dir / --to-hf)")
        out = from_hf(args.from_hf, args.out)
        print(f"wrote {out} (use it as --checkpoint.init_weights_from={out}; model config: {out}/config.yaml)")
        return 0
    if args.run_dir is None or args.to_hf is None:
        _usage("give --run-dir D --to-hf OUT_DIR, or --from-hf HF_DIR --out CKPT_DIR")
    out = Path(args.to_hf)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file()):
        _usage(f"--to-hf {out}: exists and is not an earlier Hugging Face export (no config.json); "
               "give a new or empty folder")
    step = to_hf(RunDir.open(args.run_dir), args.to_hf, args.checkpoint, args.max_shard_bytes)
    print(f"wrote {args.to_hf} (step {step}): load it with transformers' AutoModelForCausalLM / "
          "AutoTokenizer.from_pretrained")
    return 0


def _convert_lora(args) -> int:
    """``--merge-lora RUN_DIR --out DIR`` or ``--run-dir D --to-peft DIR`` (``ndtrain.cli.convert``)."""
    from ndtrain.cli.convert import merge_lora, to_peft
    from ndtrain.train.rundir import RunDir

    if args.merge_lora is not None:
        if args.out is None or args.run_dir is not None or args.to_hf or args.from_hf or args.to_peft:
            _usage("--merge-lora RUN_DIR needs --out CKPT_DIR (and no --run-dir / --to-hf / --from-hf / --to-peft)")
        out, step = merge_lora(RunDir.open(args.merge_lora), args.out, args.checkpoint)
        print(f"wrote {out} (step {step}, adapters merged; use it as --checkpoint.init_weights_from={out})")
        return 0
    if args.run_dir is None or args.to_hf or args.from_hf or args.out:
        _usage("--to-peft OUT_DIR needs --run-dir D (and no --to-hf / --from-hf / --out)")
    step = to_peft(RunDir.open(args.run_dir), args.to_peft, args.checkpoint)
    print(f"wrote {args.to_peft} (step {step}): load it with peft.PeftModel.from_pretrained(base, "
          f"{args.to_peft!r}) on the base model's Hugging Face folder")
    return 0
