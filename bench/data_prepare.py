"""``ndtrain data prepare`` throughput with 1 and 2 worker processes.

    python bench/data_prepare.py [--mbytes 16] [--chunk-docs 256]

The corpus: the standard library's ``.py`` files as JSONL (one document each), cut at ``--mbytes``
MB. The tokenizer: a byte-level BPE of 4096 entries trained (``tokenizers``) on the first 2 MB,
saved as a tokenizer.json; ``bytes`` is timed too. Each run writes a fresh folder; the files of 1 and
2 workers are compared byte for byte. Writes ``bench/results/data_prepare.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.data.corpus import stdlib_files
from ndtrain.data.prepare import prepare


def _corpus(path: Path, mbytes: int) -> tuple[int, int]:
    total, n = 0, 0
    with open(path, "w") as f:
        for p in stdlib_files():
            text = p.read_text(encoding="utf-8", errors="replace")
            f.write(json.dumps({"text": text}) + "\n")
            total, n = total + len(text.encode()), n + 1
            if total >= mbytes * 2**20:
                break
    return total, n


def _bpe(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = corpus.read_text()[: 2 * 2**20]
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|end_of_text|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=int, default=16)
    ap.add_argument("--chunk-docs", type=int, default=256)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        nbytes, ndocs = _corpus(d / "corpus.jsonl", args.mbytes)
        _bpe(d / "corpus.jsonl", d / "tokenizer.json")
        for tok in ("bytes", str(d / "tokenizer.json")):
            outs = []
            for workers in (1, 2):
                out = d / f"out-{len(runs)}"
                t0 = time.perf_counter()
                m = prepare([str(d / "corpus.jsonl")], out, workers, tok, chunk_docs=args.chunk_docs,
                            progress=False)
                s = time.perf_counter() - t0
                outs.append(out)
                runs.append({"tokenizer": "bytes" if tok == "bytes" else "bpe-4096 tokenizer.json",
                             "workers": workers, "seconds": s, "mb_per_s": nbytes / 2**20 / s,
                             "tokens_per_s": m["num_tokens"] / s, "docs_per_s": m["num_documents"] / s,
                             "tokens": m["num_tokens"], "documents": m["num_documents"]})
            same = all((outs[0] / f).read_bytes() == (outs[1] / f).read_bytes()
                       for f in ("data.bin", "data.idx", "manifest.json"))
            runs[-1]["identical_to_1_worker"] = runs[-2]["identical_to_1_worker"] = same
    out = {"corpus_bytes": nbytes, "corpus_documents": ndocs, "chunk_docs": args.chunk_docs,
           "cpus": os.cpu_count(), "load_average_1min_after": os.getloadavg()[0],
           "note": "shared 2-core machine: other jobs ran beside it", "runs": runs}
    path = ROOT / "bench" / "results" / "data_prepare.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
