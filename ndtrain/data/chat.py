"""Instruction data (``data.format: chat``): JSONL conversations -> chat template -> tokens with a
loss mask on the assistant turns -> whole conversations packed into sequences.

Input: one JSON object per line with ``messages``, a list of ``{"role": str, "content": str}``
(roles as the template knows them: ``system``, ``user``, ``assistant``...). Each conversation is
rendered by the template (``ndtrain.data.chat_template``) and tokenized as ``transformers``'
``apply_chat_template`` does: the whole string at once, no special tokens added (the template puts
its own BOS / end-of-turn tokens). A token is supervised when it starts inside an assistant span.

Prepared folder ``<cache>/chat/<key>/`` (key: source fingerprint, tokenizer, template, val_fraction):
``{train,val}.bin`` token ids (``uint16`` / ``uint32``, as ``ndtrain.data.shards``),
``{train,val}.mask.bin`` one ``uint8`` per token (1 = assistant), ``{train,val}.docs.npy`` int64
conversation offsets (n + 1), ``meta.json`` (``format: "chat"``, token and supervised counts),
``tokenizer.json`` and ``corpus_bytes.json`` (the rendered text's bytes). The validation split is
the last ``val_fraction`` of the conversations (at least one). ``max_corpus_bytes`` keeps the whole
conversations whose rendered text fits under it. Published with one ``os.rename``.

Packing (``ChatData``): conversations in file order fill rows of T + 1 tokens greedily, never split
across rows; one longer than T + 1 is cut to T + 1 (counted in ``truncated``); the rest of a row is
EOS padding, a document of its own with no loss. Row r's inputs are its first T tokens; label t is
token t + 1 when that token is supervised and in the same conversation, else -100.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ndtrain.config import DataConfig
from ndtrain.data.chat_template import ChatTemplate, load_chat_template
from ndtrain.data.corpus import resolve_files, source_fingerprint
from ndtrain.data.shards import SPLITS, TokenData, _tokenizer_id, publish_folder
from ndtrain.data.tokenizer import HFTokenizer, Tokenizer, cache_root, load_tokenizer

FORMAT_VERSION = 1
IGNORE_INDEX = -100  # the trainer's ignored label (ndtrain.train.trainer.IGNORE_INDEX)


def read_conversations(cfg: DataConfig) -> list[list[dict]]:
    """The ``messages`` of every line of ``cfg.source``'s files, in order. Raises ValueError naming
    the file and line of a malformed conversation."""
    out = []
    for path in resolve_files(cfg):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    msgs = json.loads(line)["messages"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a JSON object with 'messages' ({e})") from None
                ok = isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)
                if not ok:
                    raise ValueError(f"{path}:{n}: 'messages' must be a non-empty list of "
                                     "{'role': str, 'content': str}")
                out.append(msgs)
    if not out:
        raise ValueError(f"data.source {cfg.source!r}: no conversations")
    return out


def encode_with_mask(tok: Tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``: int64 and uint8 (n,), ``mask[i] = 1`` when token i starts inside a span.

    A ``tokenizer.json`` encodes the whole text (offsets place the tokens); the byte tokenizer
    encodes span by span, which for bytes is the same thing."""
    if isinstance(tok, HFTokenizer):
        enc = tok._tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
        mask = np.zeros(len(ids), np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask
    cuts = sorted({0, len(text), *(x for s in spans for x in s)})
    ids, mask = [], []
    for a, b in itertools.pairwise(cuts):
        piece = tok.encode(text[a:b])
        ids += piece
        mask += [int(any(s <= a < e for s, e in spans))] * len(piece)
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)


def chat_key(cfg: DataConfig, tok: Tokenizer, template: ChatTemplate, fingerprint: str) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, "fp": fingerprint, "tok": _tokenizer_id(tok), "eos": tok.eos_id,
                       "vocab": tok.vocab_size, "val": cfg.val_fraction, "template": template.digest},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _render(cfg: DataConfig, template: ChatTemplate) -> tuple[list[tuple[str, list]], int, bool]:
    """Rendered conversations with their assistant spans, whole ones only while their UTF-8 bytes
    stay within ``cfg.max_corpus_bytes`` (0 = all); returns them, their bytes, whether the cap cut."""
    out, n_bytes = [], 0
    for msgs in read_conversations(cfg):
        text, spans = template.assistant_spans(msgs)
        size = len(text.encode("utf-8"))
        if cfg.max_corpus_bytes and n_bytes + size > cfg.max_corpus_bytes:
            return out, n_bytes, True
        out.append((text, spans))
        n_bytes += size
    return out, n_bytes, False


def _write(cfg: DataConfig, tok: Tokenizer, template: ChatTemplate, out: Path) -> dict:
    convs, n_bytes, cut = _render(cfg, template)
    if len(convs) < 2:
        raise ValueError(f"data.source {cfg.source!r} gives {len(convs)} conversation(s) (data.max_corpus_bytes="
                         f"{cfg.max_corpus_bytes}): need >= 2, one for each split")
    n_val = min(len(convs) - 1, max(1, round(len(convs) * cfg.val_fraction)))
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    counts = {"num_tokens": {}, "supervised_tokens": {}, "num_documents": {}}
    for split, part in (("train", convs[:len(convs) - n_val]), ("val", convs[len(convs) - n_val:])):
        offsets, n_sup = [0], 0
        with open(out / f"{split}.bin", "wb") as ft, open(out / f"{split}.mask.bin", "wb") as fm:
            for text, spans in part:
                ids, mask = encode_with_mask(tok, text, spans)
                ft.write(ids.astype(dtype).tobytes())
                fm.write(mask.tobytes())
                offsets.append(offsets[-1] + len(ids))
                n_sup += int(mask.sum())
        np.save(out / f"{split}.docs.npy", np.asarray(offsets, np.int64))
        counts["num_tokens"][split], counts["supervised_tokens"][split] = offsets[-1], n_sup
        counts["num_documents"][split] = len(part)
    (out / "corpus_bytes.json").write_text(json.dumps({"bytes_read": n_bytes, "truncated": cut}))
    return dict(counts, dtype=np.dtype(dtype).name, max_corpus_bytes=cfg.max_corpus_bytes)


def prepare_chat(cfg: DataConfig, vocab_size: int) -> Path:
    """Render, tokenize and mask ``cfg.source``'s conversations once (cached); return the folder.

    Raises:
        ValueError: a malformed line (file:line), a template problem (``load_chat_template``,
            ``ChatTemplate.assistant_spans``), fewer than two conversations, or as ``load_tokenizer``.
    """
    tok = load_tokenizer(cfg, vocab_size)
    template = load_chat_template(cfg.chat_template, tok.spec)
    fingerprint = source_fingerprint(cfg)
    root = cache_root(cfg) / "chat"
    final = root / chat_key(cfg, tok, template, fingerprint)

    def build(tmp: Path) -> dict:
        t0 = time.perf_counter()
        meta = _write(cfg, tok, template, tmp)
        meta.update(format="chat", format_version=FORMAT_VERSION, fingerprint=fingerprint, tokenizer=tok.spec,
                    eos_id=tok.eos_id, tokenizer_vocab_size=tok.vocab_size, model_vocab_size=vocab_size,
                    source=cfg.source, chat_template=template.name, template_digest=template.digest,
                    val_fraction=cfg.val_fraction, prepare_seconds=round(time.perf_counter() - t0, 3))
        return meta

    return publish_folder(final, tok, build)


class ChatData(TokenData):
    """A prepared chat folder served as packed rows (module docstring).

    ``documents``: whether ``get`` returns the conversation ids (``data.document_mask``)."""

    def __init__(self, path: str | Path, documents: bool = False):
        super().__init__(path)
        if self.meta.get("format") != "chat":
            raise ValueError(f"{self.path} is not a prepared chat folder (meta.json format != 'chat')")
        self.documents = documents
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._rows: dict[tuple[str, int], np.ndarray] = {}

    def _split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets (n + 1,) int64, mask memmap (n_tokens,) uint8) of ``split``."""
        if split not in self._arrays:
            self.tokens(split)  # checks the split name
            self._arrays[split] = (np.load(self.path / f"{split}.docs.npy"),
                                   np.memmap(self.path / f"{split}.mask.bin", dtype=np.uint8, mode="r"))
        return self._arrays[split]

    def rows(self, split: str, seq_len: int) -> np.ndarray:
        """First conversation of each packed row, plus the total: int64 (n_rows + 1,)."""
        if (split, seq_len) not in self._rows:
            if seq_len < 1:
                raise ValueError(f"seq_len ({seq_len}) must be >= 1")
            cap, lengths = seq_len + 1, np.diff(self._split(split)[0])
            first, fill = [0], 0
            for j, n in enumerate(np.minimum(lengths, cap).tolist()):
                if fill and fill + n > cap:
                    first.append(j)
                    fill = 0
                fill += n
            self._rows[(split, seq_len)] = np.asarray(first + [len(lengths)], np.int64)
        return self._rows[(split, seq_len)]

    def num_sequences(self, split: str, seq_len: int) -> int:
        """Packed rows of ``split`` at ``seq_len``."""
        return len(self.rows(split, seq_len)) - 1

    def _row(self, split: str, r: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cap, (offsets, mask), first = seq_len + 1, self._split(split), self.rows(split, seq_len)
        toks = self.tokens(split)
        buf = np.full(cap, self.meta["eos_id"], np.int64)
        sup, doc = np.zeros(cap, bool), np.zeros(cap, np.int32)
        pos = 0
        for k, j in enumerate(range(first[r], first[r + 1])):
            a, n = offsets[j], min(offsets[j + 1] - offsets[j], cap - pos)
            buf[pos:pos + n], sup[pos:pos + n], doc[pos:pos + n] = toks[a:a + n], mask[a:a + n], k
            pos += n
        doc[pos:] = first[r + 1] - first[r]  # the padding: a document of its own
        return buf, sup, doc

    def get(self, split: str, indices: Sequence[int], seq_len: int):
        """Packed rows ``indices`` of ``split``.

        Returns:
            ``(inputs, labels, documents)``: int64 (n, T), int64 (n, T) with -100 outside the
            assistant turns and across conversations, int32 (n, T) conversation ids from 0 per row
            (None unless ``documents``).
        Raises:
            IndexError: an index outside ``[0, num_sequences(split, seq_len))``.
        """
        idx = [int(i) for i in indices]
        n_seq = self.num_sequences(split, seq_len)
        if idx and (min(idx) < 0 or max(idx) >= n_seq):
            raise IndexError(f"sequence index out of range [0, {n_seq}) for split {split!r} "
                             f"with seq_len {seq_len}: {min(idx)}..{max(idx)}")
        rows = [self._row(split, r, seq_len) for r in idx]
        buf = np.stack([b for b, _, _ in rows]).reshape(len(idx), seq_len + 1)
        sup = np.stack([s for _, s, _ in rows]).reshape(len(idx), seq_len + 1)
        doc = np.stack([d for _, _, d in rows]).reshape(len(idx), seq_len + 1)
        keep = sup[:, 1:] & (doc[:, 1:] == doc[:, :-1])
        labels = np.where(keep, buf[:, 1:], IGNORE_INDEX)
        documents = torch.from_numpy(np.ascontiguousarray(doc[:, :-1])) if self.documents else None
        return torch.from_numpy(np.ascontiguousarray(buf[:, :-1])), torch.from_numpy(labels), documents

    def supervised_labels(self, split: str, seq_len: int) -> int:
        """Labels != -100 over all packed rows of ``split``: the supervised tokens after each
        conversation's first (which has no predecessor) and within its first T + 1 tokens."""
        offsets, mask = self._split(split)
        cs = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        ends = offsets[:-1] + np.minimum(np.diff(offsets), seq_len + 1)
        return int((cs[ends] - cs[np.minimum(offsets[:-1] + 1, ends)]).sum())

    def summary(self, seq_len: int) -> dict:
        """Counts per split: conversations, tokens, supervised tokens, packed rows, labels with
        loss, their share of the rows' label positions, conversations cut to seq_len + 1."""
        out = {}
        for split in SPLITS:
            offsets, _ = self._split(split)
            n_rows, n_sup = self.num_sequences(split, seq_len), self.supervised_labels(split, seq_len)
            out[split] = {"conversations": len(offsets) - 1, "tokens": self.num_tokens(split),
                          "supervised_tokens": int(self.meta["supervised_tokens"][split]), "rows": n_rows,
                          "supervised_labels": n_sup, "supervised_share": n_sup / max(1, n_rows * seq_len),
                          "truncated": int((np.diff(offsets) > seq_len + 1).sum())}
        return out

    def console_line(self, seq_len: int) -> str:
        """One line for the start of a run: the train split's supervised share."""
        s = self.summary(seq_len)["train"]
        return (f"chat data: {s['conversations']:,} conversations -> {s['rows']:,} packed sequences of "
                f"{seq_len} | supervised (assistant) labels {s['supervised_labels']:,} = "
                f"{100 * s['supervised_share']:.1f}% of the label positions | truncated {s['truncated']} | "
                f"template {self.meta['chat_template']}")


def open_data(path: str | Path, documents: bool = False) -> TokenData:
    """The view of a prepared folder: ``ChatData`` for a chat folder, else ``TokenData``."""
    meta = Path(path) / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("format") == "chat":
        return ChatData(path, documents)
    return TokenData(path, documents)
