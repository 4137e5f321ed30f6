"""Packed documents on one process (float64): the ops' document resets, each mixer's packed forward
and backward against its documents run one by one, the ids the data path emits, and the rules.

Exactness: a packed row must give every document its own forward, so packed outputs, the summed
loss and every parameter gradient equal the per-document run to 1e-10 (measured ~1e-15); without the
ids they differ."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ConfigError, load_config, validate
from ndtrain.data.shards import TokenData
from ndtrain.model.documents import (
    document_attention,
    document_positions,
    document_starts,
    varlen_document_attention,
)
from ndtrain.model.dsa import select_topk
from ndtrain.model.mixers import LINEAR_IMPL
from ndtrain.model.sliding_window import dense_window_attention, window_attention
from ndtrain.model.transformer import build_model
from ndtrain.ops.gated_delta import chunk_gated_delta, naive_gated_delta
from ndtrain.ops.linear_attn import chunk_linear_attn, naive_linear_attn

DOCS = torch.tensor([[0] * 5 + [1] * 3 + [2] * 8, [0] * 11 + [1] * 5, [0] * 16])
B, T = DOCS.shape
f64 = torch.float64


def _pieces(docs):
    """(row, token indices) of every document."""
    return [(b, (docs[b] == d).nonzero().flatten()) for b in range(docs.shape[0]) for d in docs[b].unique().tolist()]


def test_starts_and_positions():
    assert document_starts(DOCS)[0].nonzero().flatten().tolist() == [5, 8]
    assert document_starts(DOCS, torch.tensor([0, 1, 0]))[:, 0].tolist() == [False, True, False]
    assert document_positions(DOCS)[0].tolist() == list(range(5)) + list(range(3)) + list(range(8))
    assert document_positions(DOCS)[2].tolist() == list(range(16))


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_ops_reset_at_document_starts(chunk):
    """Chunked == token loop == each document alone (the first continuing the initial state)."""
    torch.manual_seed(0)
    h, k_, v_ = 2, 4, 3
    q, k = torch.randn(B, h, T, k_, dtype=f64), F.normalize(torch.randn(B, h, T, k_, dtype=f64), dim=-1)
    v, g, beta = torch.randn(B, h, T, v_, dtype=f64), -torch.rand(B, h, T, dtype=f64), torch.rand(B, h, T, dtype=f64)
    s0, resets = torch.randn(B, h, k_, v_, dtype=f64), document_starts(DOCS)
    for chunked, naive, extra in ((chunk_linear_attn, naive_linear_attn, ()),
                                  (chunk_gated_delta, naive_gated_delta, (beta,))):
        o_c, s_c = chunked(q, k, v, g, *extra, s0, chunk, resets=resets)
        o_n, s_n = naive(q, k, v, g, *extra, s0, resets=resets)
        assert (o_c - o_n).abs().max() < 1e-12 and (s_c - s_n).abs().max() < 1e-12
        for b, idx in _pieces(DOCS):
            sl = (slice(b, b + 1), slice(None), idx)
            init = s0[b:b + 1] if idx[0] == 0 else None
            o_d, s_d = naive(q[sl], k[sl], v[sl], g[sl], *(x[sl] for x in extra), init)
            assert (o_d - o_c[sl]).abs().max() < 1e-12
            if idx[-1] == T - 1:
                assert (s_d - s_c[b:b + 1]).abs().max() < 1e-12
        assert (chunked(q, k, v, g, *extra, s0, chunk)[0] - o_c).abs().max() > 1e-3  # resets matter


def test_attention_forms_agree():
    torch.manual_seed(1)
    q, k, v = torch.randn(B, 4, T, 8, dtype=f64), torch.randn(B, 2, T, 8, dtype=f64), torch.randn(B, 2, T, 8, dtype=f64)
    assert (document_attention(q, k, v, DOCS) - varlen_document_attention(q, k, v, DOCS)).abs().max() < 1e-13
    for w in (1, 3, 5):  # blocked sliding window == its band-masked twin, both inside documents
        blocked = window_attention(q, k, v, w, documents=DOCS)
        assert (blocked - dense_window_attention(q, k, v, w, documents=DOCS)).abs().max() < 1e-13
    scores = torch.randn(B, T, T, dtype=f64)
    idx, valid = select_topk(scores, 4, documents=DOCS)
    picked = torch.gather(DOCS[:, None, :].expand(B, T, T), 2, idx)  # (B, T, k) key documents
    assert bool(((picked == DOCS[:, :, None]) | ~valid).all())
    assert int(valid.sum()) == sum(min(4, int(p)) for p in (document_positions(DOCS) + 1).flatten())


def _model(pattern: str, **over):
    ov = {"model.layer_pattern": pattern, "model.n_layers": len(pattern), "model.dim": 32, "model.n_heads": 4,
          "model.n_kv_heads": 2, "model.vocab_size": 64, "model.max_seq_len": 64, "model.swa_window": 3,
          "model.dsa_top_k": 16, "model.linear_chunk_size": 4, "model.ffn_hidden": 48, **over}
    return build_model(load_config("debug", ov).model, dtype=f64)


def _loss_grads(m, x, y, documents=None, pieces=None):
    m.zero_grad()
    if pieces is None:
        loss = F.cross_entropy(m(x, documents=documents).flatten(0, 1), y.flatten(), reduction="sum")
    else:
        loss = sum(F.cross_entropy(m(x[b:b + 1, i])[0], y[b, i], reduction="sum") for b, i in pieces)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


CASES = {"softmax": ("A", {}), "sliding_window": ("S", {}), "gated_deltanet": ("G", {}), "mamba2": ("M", {}),
         "linear": ("L", {}), "dsa": ("D", {}), "mla": ("A", {"model.attention": "mla", "model.mla_kv_rank": 16,
                                                            "model.mla_rope_dim": 4, "model.mla_nope_dim": 8})}


@pytest.mark.parametrize("case, impl", [(c, "chunk") for c in CASES] + [
    pytest.param(c, "naive", marks=pytest.mark.slow) for c in ("gated_deltanet", "mamba2", "linear")])
def test_packed_model_equals_documents_one_by_one(case, impl):
    """``impl`` naive: the linear family's token-loop twin (slow)."""
    pattern, over = CASES[case]
    torch.manual_seed(2)
    m = _model(pattern, **over)
    x, y = torch.randint(0, 64, (B, T)), torch.randint(0, 64, (B, T))
    LINEAR_IMPL["impl"] = impl
    try:
        packed, g_packed = _loss_grads(m, x, y, DOCS)
        alone, g_alone = _loss_grads(m, x, y, pieces=_pieces(DOCS))
        plain, g_plain = _loss_grads(m, x, y)
    finally:
        LINEAR_IMPL["impl"] = "chunk"
    assert abs(packed - alone) / alone < 1e-12
    # the DSA indexer's own KL is a mean over a row's queries (not a sum over documents): main weights only
    names = [n for n in g_alone if "index" not in n]

    def grad_err(g):
        return max(((g[n] - g_alone[n]).abs().max() / g_alone[n].abs().max().clamp(min=1e-30)).item() for n in names)

    assert grad_err(g_packed) < 1e-10
    assert grad_err(g_plain) > 1e-3 and plain != alone  # without the ids documents see each other


def test_token_data_numbers_documents(tmp_path):
    eos = 7
    stream = np.array([1, 2, eos, 3, 4, 5, eos, 6, eos, 2, 2, 2, 2], dtype=np.uint16)
    stream.tofile(tmp_path / "train.bin")
    stream.tofile(tmp_path / "val.bin")
    meta = {"dtype": "uint16", "num_tokens": {"train": len(stream), "val": len(stream)}, "eos_id": eos,
            "tokenizer": "bytes"}
    (tmp_path / "meta.json").write_text(__import__("json").dumps(meta))
    x, y, d = TokenData(tmp_path, document_mask=True).get("train", [0, 1], 6)
    assert x.tolist() == [[1, 2, 7, 3, 4, 5], [7, 6, 7, 2, 2, 2]]
    assert d.dtype == torch.int32 and d.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 2, 2, 2]]
    assert y.tolist() == [[2, 7, -100, 4, 5, 7], [-100, 7, -100, 2, 2, 2]]  # no loss where an EOS is the input
    x2, y2, d2 = TokenData(tmp_path).get("train", [0, 1], 6)
    assert d2 is None and torch.equal(x2, x) and y2[0, 2] == 3


def test_rule_refuses_mtp_with_documents():
    with pytest.raises(ConfigError, match=r"data.document_mask=true with model.mtp_depth \(1\) > 0"):
        load_config("debug", {"data.document_mask": True, "model.mtp_depth": 1})
    validate(load_config("debug", {"data.document_mask": True}))
