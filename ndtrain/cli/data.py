"""``ndtrain data prepare SOURCE... --out DIR [--workers N]``: tokenize a corpus into a Megatron
``.bin`` / ``.idx`` folder with a manifest (``ndtrain.data.prepare``); a re-run continues."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    dp = sub.add_parser("data", help="data tools: prepare (tokenize a corpus into pre-tokenized files)")
    dsub = dp.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="tokenize SOURCE... in worker processes into OUT/data.{bin,idx}",
                        description="Tokenize txt / JSONL / parquet sources (paths, globs, folders) into "
                                    "OUT/data.bin + data.idx (Megatron format) and OUT/manifest.json; "
                                    "re-running the same command continues an interrupted run.")
    p.add_argument("sources", nargs="+", help="paths, globs or folders of txt / JSONL / parquet")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes (the files do not depend on it)")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes, a tokenizer.json path, or bpe (trained on the sources)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="bpe: vocabulary to train; else the ids must fit")
    p.add_argument("--text-field", default="text", help="JSONL / parquet column holding the text")
    p.add_argument("--chunk-docs", type=int, default=1024, help="documents per part (the unit of resume)")
    p.add_argument("--cache-dir", default="", help="where a trained bpe tokenizer is cached")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ndtrain.config import ConfigError
    from ndtrain.data.prepare import prepare

    if args.data_command != "prepare":
        return 1
    try:
        manifest = prepare(args.sources, args.out, args.workers, args.tokenizer, args.text_field,
                           args.vocab_size, args.chunk_docs, args.cache_dir, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data prepare: {e}") from None
    if manifest.get("already_prepared"):
        print(f"{args.out}: already prepared from these inputs; nothing to do", flush=True)
    return 0
