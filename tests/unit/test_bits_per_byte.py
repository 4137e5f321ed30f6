"""Bits per byte counts the bytes of the decoded text of the evaluated span, for every tokenizer
family: checked against hand-counted totals for a SentencePiece-style tokenizer (``▁`` spaces with
a prefix space per document, byte-fallback pieces), and against the UTF-8 size of each decoded
document."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ModelConfig
from ndtrain.data.tokenizer import HFTokenizer
from ndtrain.inference.evaluate import evaluate, stream_byte_counts, token_byte_lengths
from ndtrain.model import build_model
from tests.sp_tokenizer import build_sp_tokenizer

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def sp(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer(build_sp_tokenizer(tmp_path_factory.mktemp("sp")))


def test_sentencepiece_stream_bytes_are_hand_counted(sp):
    ids = sp.encode_docs(["the cat", "café ☃"])
    assert [sp._tok.id_to_token(i) for i in ids] == [
        "▁the", "▁cat", "</s>", "▁caf", "<0xC3>", "<0xA9>", "▁", "<0xE2>", "<0x98>", "<0x83>", "</s>"]
    counts = stream_byte_counts(sp, ids, 300)
    # "the" (the prefix space is not text), " cat", EOS, "caf", é on its second byte piece, " ",
    # ☃ on its third byte piece, EOS
    assert counts.tolist() == [3, 4, 0, 3, 0, 2, 1, 0, 0, 3, 0]
    assert token_byte_lengths(sp, 300) is None  # context-dependent: no per-id table


def test_document_bytes_sum_to_the_decoded_text(sp):
    docs = ["the cat sat on the cat", "naïve café ☃ on €5 🙂", "c", "the  cat"]
    ids = sp.encode_docs(docs)
    counts = stream_byte_counts(sp, ids, 300)
    ends = np.flatnonzero(ids == sp.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    for doc, a, b in zip(docs, starts, ends):
        assert sp.decode(ids[a:b].tolist()) == doc
        assert int(counts[a:b].sum()) == len(doc.encode("utf-8")), doc


@torch.no_grad()
def test_evaluate_divides_by_the_evaluated_bytes(sp):
    """One window of T = 10 over 11 tokens: the labels are every position but the first
    (``▁the``: 3 bytes), so the evaluated span holds 7 - 3 + 9 = 13 bytes (EOS: 0). Counting each
    piece decoded alone gave 21 (3 bytes per lone byte piece, the U+FFFD it decodes to)."""
    ids = sp.encode_docs(["the cat", "café ☃"])
    cfg = ModelConfig(vocab_size=300, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=24,
                      max_seq_len=16)
    model = build_model(cfg, seed=0).eval()
    got = evaluate(model, ids, 10, 1, stream_byte_counts(sp, ids, 300))
    x = torch.from_numpy(ids.astype(np.int64))[None]
    ce = F.cross_entropy(model(x[:, :-1])[0].float(), x[0, 1:], reduction="sum").item()
    assert got["bytes"] == 13 and got["tokens"] == 10
    assert got["bits_per_byte"] == pytest.approx(ce / (math.log(2) * 13), rel=1e-12)
