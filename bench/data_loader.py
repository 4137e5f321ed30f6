"""Pre-tokenized loader throughput against what a training step consumes.

    python bench/data_loader.py [--tokens 20000000] [--seq-len 2048] [--batch 8] [--steps 40]

Writes a Megatron ``.bin`` / ``.idx`` and a ``.npy`` token file with offsets (random documents of
64..4096 tokens) to a temporary folder, mixes them 70 / 30 (``data.sources``) with document ids on,
and times ``MixtureData.get`` of consecutive global batches (the files are in the page cache, as
after a first epoch). The need is the ``default`` preset's tokens per second in
``bench/results/step_time_single.json`` (one CPU process). Writes ``bench/results/data_loader.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import DataConfig, load_config
from ndtrain.data.megatron_index import write_index
from ndtrain.data.mixture import MixtureData, MixtureSampler, prepare_mixture


def _docs(rng, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(64, 4097, n_tokens // 64)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), n_tokens) + 1]
    return rng.integers(0, 32000, int(lengths.sum())).astype(np.uint16), lengths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        tokens, lengths = _docs(rng, int(args.tokens * 0.7))
        tokens.tofile(d / "web.bin")
        write_index(d / "web.idx", lengths, np.arange(len(lengths) + 1), np.uint16)
        code, code_len = _docs(rng, int(args.tokens * 0.3))
        np.save(d / "code.npy", code)
        np.save(d / "code_off.npy", np.concatenate([[0], np.cumsum(code_len)[:-1]]))
        sources = json.dumps([{"kind": "megatron", "path": str(d / "web"), "weight": 0.7, "name": "web"},
                              {"kind": "tokens", "path": str(d / "code.npy"), "offsets": str(d / "code_off.npy"),
                               "weight": 0.3, "name": "code"}])
        cfg = DataConfig(tokenizer="bytes", cache_dir=str(d / "cache"), seq_len=args.seq_len, sources=sources)
        data = MixtureData(prepare_mixture(cfg, 32000), seed=0, document_mask=True)
        sampler = MixtureSampler(1, args.batch, 0)
        for _ in range(3):
            data.get("train", sampler.next_global(), args.seq_len)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            data.get("train", sampler.next_global(), args.seq_len)
        seconds = time.perf_counter() - t0
    loader_tps = args.steps * args.batch * args.seq_len / seconds
    need = json.loads((ROOT / "bench" / "results" / "step_time_single.json").read_text())
    preset = load_config(need["config"])
    need_tps = preset.training.global_batch_size * preset.data.seq_len / need["ndtrain_step_s"]
    out = {"loader_tokens_per_s": loader_tps, "batch_ms": 1000 * seconds / args.steps,
           "tokens": int(args.tokens), "seq_len": args.seq_len, "global_batch": args.batch,
           "document_mask": True, "sources": "megatron 0.7 + npy with offsets 0.3, page cache warm",
           "train_step_tokens_per_s": need_tps, "train_step_source": "bench/results/step_time_single.json "
           f"(preset {need['config']}, {need['ndtrain_step_s']:.3f} s per step, one CPU process)",
           "loader_over_need": loader_tps / need_tps, "load_average_1min_after": os.getloadavg()[0]}
    path = ROOT / "bench" / "results" / "data_loader.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
