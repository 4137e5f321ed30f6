"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``): written and read by memory map.

``.bin``: the token ids of every sequence back to back, one dtype, no header. ``.idx`` (little-endian):

    b"MMIDIDX\\x00\\x00"            9-byte magic
    uint64  version = 1
    uint8   dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    uint64  S: sequences
    uint64  D: entries of the document index (documents + 1)
    int32   lengths[S]          tokens per sequence
    int64   pointers[S]         byte offset of each sequence in .bin
    int64   doc_index[D]        first sequence of each document, then S

A document is one or more consecutive sequences (``ndtrain data prepare`` writes one per document).
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def dtype_code(dtype) -> int:
    """The ``.idx`` code of a numpy dtype. Raises ValueError for one the format has no code for."""
    for code, dt in _CODES.items():
        if np.dtype(dt) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype).name} has no Megatron .idx code")


def prefix_of(path: str | Path) -> Path:
    """``a/b`` from ``a/b``, ``a/b.bin`` or ``a/b.idx``."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def write_index(idx_path: str | Path, lengths, doc_index, dtype) -> None:
    """Write a ``.idx`` for sequences of ``lengths`` tokens laid out back to back in ``dtype``.

    ``doc_index``: int (D,), first sequence of each document then ``len(lengths)``."""
    lengths = np.asarray(lengths, dtype=np.int32)
    doc_index = np.asarray(doc_index, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_index.astype("<i8").tobytes())


def write_dataset(prefix: str | Path, documents: list, dtype=np.uint16) -> None:
    """``PREFIX.bin`` / ``PREFIX.idx`` holding ``documents`` (each a 1-D int array), one sequence each."""
    prefix = Path(prefix)
    with open(prefix.with_suffix(".bin"), "wb") as f:
        f.writelines(np.asarray(doc).astype(dtype).tobytes() for doc in documents)
    write_index(prefix.with_suffix(".idx"), [len(d) for d in documents], np.arange(len(documents) + 1), dtype)


class MegatronIndex:
    """The ``.idx`` of ``prefix`` (memory-mapped arrays) and its ``.bin`` as a flat token memmap.

    Raises ValueError naming the file for a missing file, a wrong magic / version, an unknown dtype
    code, or a ``.bin`` shorter than the index says."""

    def __init__(self, prefix: str | Path):
        self.prefix = prefix_of(prefix)
        idx, bin_ = self.prefix.with_suffix(".idx"), self.prefix.with_suffix(".bin")
        for p in (idx, bin_):
            if not p.is_file():
                raise ValueError(f"Megatron dataset {self.prefix}: no file {p}")
        with open(idx, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx}: not a Megatron .idx (magic {head[:len(MAGIC)]!r}, expected {MAGIC!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != 1:
            raise ValueError(f"{idx}: index version {version}, only 1 is known")
        if code not in _CODES:
            raise ValueError(f"{idx}: unknown dtype code {code}")
        self.dtype = np.dtype(_CODES[code])
        mm = np.memmap(idx, dtype=np.uint8, mode="r")
        off = _HEADER
        self.lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.doc_index = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=off)
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r")
        end = int(self.pointers[-1]) // self.dtype.itemsize + int(self.lengths[-1]) if n_seq else 0
        if end > len(self.tokens):
            raise ValueError(f"{bin_}: {len(self.tokens)} tokens, the index needs {end}")

    @property
    def num_documents(self) -> int:
        return max(0, len(self.doc_index) - 1)

    def doc_starts(self) -> np.ndarray:
        """Token offset of each document's first token in the flat ``.bin``: int64 (num_documents,)."""
        first = self.doc_index[:-1]
        return self.pointers[first] // self.dtype.itemsize

    def document(self, d: int) -> np.ndarray:
        """The tokens of document ``d`` (all its sequences), a view of the memmap."""
        a, b = int(self.doc_index[d]), int(self.doc_index[d + 1])
        if a == b:
            return self.tokens[:0]
        start = int(self.pointers[a]) // self.dtype.itemsize
        return self.tokens[start:int(self.pointers[b - 1]) // self.dtype.itemsize + int(self.lengths[b - 1])]
