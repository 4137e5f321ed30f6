"""``ndtrain data prepare``: tokenize a corpus in worker processes into a Megatron ``.bin`` / ``.idx``.

The documents of the sources (``ndtrain.data.corpus``; txt / JSONL / parquet, globs, folders) are cut
into parts of ``chunk_docs`` documents in reading order, so the parts, and the files merged from
them, are the same for any number of workers. Worker processes (forked where the platform can,
else spawned) tokenize parts (each document followed by the EOS id) into
``OUT/parts/part-NNNNNN.{bin,len.npy}``, each published by a rename; a re-run skips the parts
already there. When all are done they are merged into
``OUT/data.bin`` / ``OUT/data.idx`` (one sequence per document) and ``OUT/manifest.json`` is written
last: its presence means the folder is complete. ``OUT/prepare.json`` pins the inputs, so a re-run with
other inputs is refused rather than mixed in.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ndtrain.config import DataConfig
from ndtrain.data.megatron_index import write_index

MANIFEST = "manifest.json"


def tokenizer_id(spec: str) -> str:
    """``bytes`` or the sha256 of the tokenizer file: what must match between a folder and a run."""
    return "bytes" if spec == "bytes" else "sha256:" + hashlib.sha256(Path(spec).read_bytes()).hexdigest()


def _publish(path: Path, data: bytes | np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, np.ndarray):
            np.save(f, data)
        else:
            f.write(data)
    os.replace(tmp, path)


def _part_paths(parts: Path, i: int) -> tuple[Path, Path]:
    return parts / f"part-{i:06d}.bin", parts / f"part-{i:06d}.len.npy"


def _tokenize_part(job) -> tuple[int, int, int]:
    """Worker: tokenize part ``i`` and publish it; returns (i, documents, tokens)."""
    i, docs, spec, eos_id, dtype, parts = job
    from ndtrain.data.tokenizer import open_tokenizer

    tok = open_tokenizer(spec, eos_id=eos_id)
    tok.eos_id = eos_id
    ids = [np.asarray(d, dtype=np.int64) for d in tok.encode_batch(docs)]
    lengths = np.array([len(d) + 1 for d in ids], dtype=np.int64)
    flat = np.concatenate([np.append(d, eos_id) for d in ids]) if ids else np.zeros(0, np.int64)
    tokens_path, len_path = _part_paths(Path(parts), i)
    _publish(tokens_path, flat.astype(dtype).tobytes())
    _publish(len_path, lengths)  # last: a part is done when its lengths file exists
    return i, len(ids), int(flat.size)


def _chunks(docs: Iterable[str], n: int) -> Iterator[tuple[int, list[str], int]]:
    chunk, nbytes, i = [], 0, 0
    for d in docs:
        chunk.append(d)
        nbytes += len(d)
        if len(chunk) == n:
            yield i, chunk, nbytes
            chunk, nbytes, i = [], 0, i + 1
    if chunk:
        yield i, chunk, nbytes


class _Bar:
    """A one-line progress bar on stderr: share of the corpus characters read, parts, tokens/s."""

    def __init__(self, total_chars: int, enabled: bool):
        self.total, self.enabled, self.t0 = max(1, total_chars), enabled, time.perf_counter()

    def show(self, chars: int, parts: int, tokens: int) -> None:
        if not self.enabled:
            return
        frac = min(1.0, chars / self.total)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = tokens / max(1e-9, time.perf_counter() - self.t0)
        sys.stderr.write(f"\rprepare [{bar}] {100 * frac:5.1f}%  {parts} parts  {tokens:,} tokens  "
                         f"{rate:,.0f} tok/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _pin(out: Path, inputs: dict) -> None:
    """Write ``prepare.json`` or check that an existing one names the same inputs."""
    pin = out / "prepare.json"
    if pin.is_file():
        old = json.loads(pin.read_text())
        if old != inputs:
            diff = sorted(k for k in inputs if old.get(k) != inputs[k])
            raise ValueError(f"{out} holds a prepare of other inputs ({', '.join(diff)} differ); "
                             "use another --out or delete it")
    else:
        pin.write_text(json.dumps(inputs, indent=2, sort_keys=True))


def prepare(sources: list[str], out: str | Path, workers: int = 1, tokenizer: str = "bytes",
            text_field: str = "text", vocab_size: int = 4096, chunk_docs: int = 1024, cache_dir: str = "",
            progress: bool = True, stop_after_parts: int = 0) -> dict:
    """Tokenize ``sources`` into ``out`` (see the module docstring); returns the manifest.

    ``stop_after_parts`` > 0 ends after that many new parts, leaving a folder a re-run completes.
    Raises ValueError for unreadable sources, a tokenizer that does not fit ``vocab_size`` or an
    ``out`` holding another prepare."""
    from ndtrain.data.corpus import iter_documents, resolve_files, source_fingerprint
    from ndtrain.data.tokenizer import load_tokenizer

    if workers < 1 or chunk_docs < 1:
        raise ValueError(f"--workers ({workers}) and --chunk-docs ({chunk_docs}) must be >= 1")
    cfg = DataConfig(source=",".join(sources), text_field=text_field, tokenizer=tokenizer, cache_dir=cache_dir)
    out = Path(out)
    tok = load_tokenizer(cfg, vocab_size)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32  # the .idx format has no uint32 code
    inputs = {"fingerprint": source_fingerprint(cfg), "sources": list(sources), "text_field": text_field,
              "tokenizer": tokenizer_id(tok.spec), "eos_id": tok.eos_id, "chunk_docs": chunk_docs,
              "dtype": np.dtype(dtype).name}
    if (out / MANIFEST).is_file():  # finished before: the same inputs (else ValueError), nothing to do
        _pin(out, inputs)
        return {**json.loads((out / MANIFEST).read_text()), "already_prepared": True}
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    _pin(out, inputs)
    bar = _Bar(sum(p.stat().st_size for p in resolve_files(cfg)), progress)
    done = {int(p.name[5:11]) for p in parts.glob("part-*.len.npy")}  # published by an earlier run
    state = {"chars": 0, "parts": len(done), "tokens": 0, "new": 0}
    chars_of: dict[int, int] = {}  # characters of the parts in flight, counted when they finish

    def pending():
        for i, docs, nchars in _chunks(iter_documents(cfg), chunk_docs):
            if i in done:
                state["chars"] += nchars
                continue
            chars_of[i] = nchars
            if stop_after_parts and state["new"] >= stop_after_parts:
                return
            state["new"] += 1
            yield i, docs, tok.spec, tok.eos_id, dtype, str(parts)

    t0 = time.perf_counter()
    if workers == 1:
        results = map(_tokenize_part, pending())
        pool = None
    else:
        # fork where there is one (as torch's DataLoader workers): a spawned worker pays seconds of imports
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = mp.get_context(method).Pool(workers)
        results = pool.imap(_tokenize_part, pending())
    try:
        for i, _, n_tok in results:
            state["chars"] += chars_of.pop(i)
            state["parts"] += 1
            state["tokens"] += n_tok
            bar.show(state["chars"], state["parts"], state["tokens"])
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        bar.close()
    if stop_after_parts and state["new"] >= stop_after_parts:
        return {"stopped_after_parts": state["new"]}
    manifest = _merge(out, parts, dtype, tok, inputs)
    print(f"prepared {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in "
          f"{time.perf_counter() - t0:.1f}s ({workers} workers) -> {out}", flush=True)
    return manifest


def _merge(out: Path, parts: Path, dtype, tok, inputs: dict) -> dict:
    """Concatenate the parts into ``data.bin`` / ``data.idx``, then write the manifest (last)."""
    n_parts = len(list(parts.glob("part-*.len.npy")))
    lengths = [np.load(_part_paths(parts, i)[1]) for i in range(n_parts)]
    tmp_bin = out / "data.bin.tmp"
    with open(tmp_bin, "wb") as f:
        for i in range(n_parts):
            with open(_part_paths(parts, i)[0], "rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
    all_len = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    write_index(out / "data.idx.tmp", all_len, np.arange(len(all_len) + 1), dtype)
    os.replace(tmp_bin, out / "data.bin")
    os.replace(out / "data.idx.tmp", out / "data.idx")
    if tok.spec != "bytes":
        shutil.copyfile(tok.spec, out / "tokenizer.json")
    manifest = {"format": "megatron", "prefix": "data", **inputs, "tokenizer_vocab_size": tok.vocab_size,
                "num_documents": len(all_len), "num_tokens": int(all_len.sum()), "num_parts": n_parts}
    _publish(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    shutil.rmtree(parts)
    return manifest


def write_token_documents(out: Path, docs: Iterable[np.ndarray], dtype, meta: dict) -> dict:
    """One process: ``docs`` (token arrays, as they are) into ``out/data.bin`` / ``data.idx`` and the
    manifest (``meta`` + counts), built in a temporary folder and published by one rename."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    lengths = []
    with open(tmp / "data.bin", "wb") as f:
        for d in docs:
            a = np.asarray(d, dtype=np.int64)
            if a.size:
                f.write(a.astype(dtype).tobytes())
                lengths.append(a.size)
    write_index(tmp / "data.idx", lengths, np.arange(len(lengths) + 1), dtype)
    manifest = {"format": "megatron", "prefix": "data", **meta, "num_documents": len(lengths),
                "num_tokens": int(sum(lengths))}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    try:
        os.rename(tmp, out)
    except OSError:
        if not (out / MANIFEST).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process published it first
    return manifest
