"""Mixtures of sources: shares, exact resume / reshard, document ids, the config forms, Megatron files."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from ndtrain.config import ConfigError, DataConfig, config_from_dict, load_config
from ndtrain.data.megatron_index import MAGIC, MegatronIndex, write_dataset
from ndtrain.data.mixture import MixtureData, MixturePlan, MixtureSampler, prepare_mixture
from ndtrain.data.pretokenized import TokenStream
from ndtrain.data.sources import parse_sources

T = 16


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Three sources whose ids lie in disjoint ranges: [0, 100) npy, [100, 150) megatron, text of é (bytes >= 150)."""
    d = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    np.save(d / "a.npy", rng.integers(0, 100, 60_000).astype(np.uint16))
    np.save(d / "a_off.npy", np.arange(0, 60_000, 50, dtype=np.int64))
    write_dataset(d / "m", [rng.integers(100, 150, int(n)) for n in rng.integers(3, 90, 800)])
    (d / "t").mkdir()
    for i in range(8):
        (d / "t" / f"{i}.txt").write_text("é" * 500 + f" {i}")  # bytes 0xC3 0xA9: ids 195 and 169
    sources = (f'[{{"kind": "tokens", "path": "{d}/a.npy", "offsets": "{d}/a_off.npy", "weight": 5}},'
               f'{{"kind": "megatron", "path": "{d}/m", "weight": 3, "name": "web"}},'
               f'{{"kind": "text", "path": "{d}/t", "weight": 2}}]')
    cfg = DataConfig(tokenizer="bytes", cache_dir=str(d / "cache"), sources=sources, seq_len=T)
    return prepare_mixture(cfg, 300)


def _source_of_rows(inputs: torch.Tensor) -> np.ndarray:
    """0 / 1 / 2 per row from the id ranges of the fixture's sources (every text window holds an é)."""
    hi = inputs.max(1).values.numpy()
    return np.where(hi >= 150, 2, np.where(hi >= 100, 1, 0))


def test_shares_within_one_percent_over_10000_sequences(mixture):
    data = MixtureData(mixture, seed=3)
    inputs, labels, docs = data.get("train", range(10_000), T)
    assert docs is None  # document_mask off
    src = _source_of_rows(inputs)
    counts = np.bincount(src, minlength=3)
    assert np.all(np.abs(counts / 10_000 - [0.5, 0.3, 0.2]) < 0.01), counts
    shares = data.log_fields(10_000)
    assert shares == {f"data_share_{n}": c / 10_000 for n, c in zip(["s0", "web", "s2"], counts)}
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    for k in (1, 999, 1023, 1025, 4097):  # partial blocks too
        assert np.array_equal(data.plans["train"].seen(k), np.bincount(src[:k], minlength=3))


def test_block_quotas_never_negative_and_exact_after_each_block():
    plan = MixturePlan([0.998, 0.001, 0.001], seed=0)
    assert plan.block >= 2000
    for b in range(40):
        q = plan.before(b + 1) - plan.before(b)
        assert q.min() >= 0 and q.sum() == plan.block
        assert np.all(np.abs(plan.before(b) - b * plan.block * plan.weights) <= 2)


def test_every_prefix_is_near_the_weights():
    plan = MixturePlan([0.5, 0.3, 0.15, 0.05], seed=4)
    src, draw = plan.locate(range(3 * plan.block))
    counts = np.cumsum(np.eye(4, dtype=np.int64)[src], axis=0)  # (n, S) windows per source in each prefix
    n = np.arange(1, len(src) + 1)[:, None]
    assert np.abs(counts - n * plan.weights).max() <= 4  # about one window per source, never more than S
    for s in range(4):  # draw numbers count each source's windows 0, 1, 2, ... in stream order
        assert draw[src == s].tolist() == list(range(int((src == s).sum())))


def _global_batches(data, sampler, steps, dp):
    """Each step's global batch as the dp ranks see it: their local slices, concatenated in rank order."""
    out = []
    for _ in range(steps):
        idx = sampler.next_global()
        parts = [data.get("train", sampler.local_slice(idx, r, dp), T)[0] for r in range(dp)]
        out.append(torch.cat(parts))
    return out


def test_resume_under_another_dp_degree_gives_the_uninterrupted_sequences(mixture):
    data = MixtureData(mixture, seed=7)
    G, k, n = 8, 5, 12
    full = _global_batches(data, MixtureSampler(100, G, 7), n, dp=1)
    first = MixtureSampler(100, G, 7)
    head = _global_batches(data, first, k, dp=2)
    state = first.state_dict()
    resumed = MixtureSampler(100, G, 7)
    resumed.load_state_dict(state)
    tail = _global_batches(MixtureData(mixture, seed=7), resumed, n - k, dp=4)  # a fresh process's data
    for a, b in zip(full, head + tail):
        assert torch.equal(a, b)
    assert not torch.equal(full[0], _global_batches(MixtureData(mixture, seed=8), MixtureSampler(100, G, 8), 1, 1)[0])


def test_document_ids_start_at_each_boundary():
    tokens = np.arange(40, dtype=np.uint16)
    st = TokenStream(tokens, np.array([5, 13, 14]), None, "x")
    _, _, docs = st.windows([0, 1], 8)
    assert docs.dtype == torch.int32
    assert docs.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 2, 2]]  # row 1 is tokens 8..15
    eos = TokenStream(np.array([1, 9, 2, 3, 9, 9, 4, 5, 6], dtype=np.uint16), None, 9, "y")
    assert eos.windows([0], 8)[2].tolist() == [[0, 0, 1, 1, 1, 2, 3, 3]]  # a new id after each EOS


def test_mixture_documents_when_masking(mixture):
    data = MixtureData(mixture, seed=0, document_mask=True)
    src, win = data.locate("train", range(64), T)
    docs = data.get("train", range(64), T)[2]
    row = int(np.flatnonzero(src == 0)[0])
    start = int(win[row]) * T  # source 0 has a document every 50 tokens
    want = (np.arange(start, start + T) // 50) - start // 50
    assert docs[row].tolist() == want.tolist()


def test_vocab_overflow_names_the_source_before_any_batch(tmp_path):
    """Found while preparing (before any rank starts), in either split: here only the val split's
    last token is past the vocabulary, which the first training batches would never read."""
    ids = np.full(1000, 7, dtype=np.uint16)
    ids[-1] = 400
    np.save(tmp_path / "big.npy", ids)
    cfg = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), seq_len=T,
                     sources=f"tokens:{tmp_path}/big.npy@1")
    with pytest.raises(ValueError, match=r"^source s0: token id 400 >= model.vocab_size \(300\)$"):
        prepare_mixture(cfg, 300)
    assert MixtureData(prepare_mixture(cfg, 401)).get("train", [0], T)[0].max() == 7


def test_config_forms_agree():
    compact = parse_sources("tokens:a.npy@3; megatron:b@1")
    assert [(s.kind, s.path, s.weight, s.name) for s in compact] == [("tokens", "a.npy", 0.75, "s0"),
                                                                      ("megatron", "b", 0.25, "s1")]
    tree = {"data": {"sources": [{"kind": "tokens", "path": "a.npy", "weight": 3},
                                 {"kind": "megatron", "path": "b", "weight": 1}]}}
    cfg = config_from_dict(tree)
    assert parse_sources(cfg.data.sources) == compact
    budget = parse_sources('[{"kind": "hf", "path": "d", "budget_tokens": 100}, {"kind": "text", "path": "x", "budget_tokens": 300}]')
    assert [s.weight for s in budget] == [0.25, 0.75]


@pytest.mark.parametrize("text, error", [
    ("tokens:a.npy", "data.sources entry 0 ('tokens:a.npy') is not KIND:PATH@WEIGHT"),
    ("disk:a@1", "data.sources entry 0: kind 'disk' is not one of text, tokens, megatron, hf"),
    ('[{"kind": "tokens", "path": "a", "weight": 1, "budget_tokens": 5}]',
     "data.sources entry 0 (s0): give exactly one of weight > 0 or budget_tokens > 0 (weight=1, budget_tokens=5)"),
    ('[{"kind": "tokens", "path": "a", "wieght": 1}]',
     ("data.sources entry 0: unknown key 'wieght'; keys: budget_tokens, dtype, eos_id, field, kind, name, "
      "offsets, path, streaming, weight")),
])
def test_bad_sources_are_one_line_errors(text, error):
    with pytest.raises(ValueError) as e:
        parse_sources(text)
    assert str(e.value) == error


def test_megatron_files_match_the_format_spec(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([65535, 0])]
    write_dataset(tmp_path / "d", docs, np.uint16)
    want = (MAGIC + struct.pack("<QBQQ", 1, 8, 3, 4) + struct.pack("<3i", 3, 0, 2)
            + struct.pack("<3q", 0, 6, 6) + struct.pack("<4q", 0, 1, 2, 3))
    assert (tmp_path / "d.idx").read_bytes() == want
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<5H", 5, 6, 7, 65535, 0)
    ix = MegatronIndex(tmp_path / "d.bin")
    assert [ix.document(i).tolist() for i in range(3)] == [[5, 6, 7], [], [65535, 0]]
    assert ix.doc_starts().tolist() == [0, 3, 3] and isinstance(ix.tokens, np.memmap)
    (tmp_path / "bad.idx").write_bytes(b"XXXX" + want[4:])
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a Megatron .idx"):
        MegatronIndex(tmp_path / "bad")


def test_unreadable_source_is_a_config_error_before_start(tmp_path):
    from ndtrain.cli.launch import prepare_checked

    cfg = load_config("debug", {"data.sources": f"tokens:{tmp_path}/none.npy@1", "data.tokenizer": "bytes",
                                "data.cache_dir": str(tmp_path), "model.vocab_size": 512})
    with pytest.raises(ConfigError) as e:
        prepare_checked(cfg)
    assert str(e.value) == f"data: data.sources s0: token file {tmp_path}/none.npy does not exist"


def test_short_source_and_foreign_tokenizer_are_named(tmp_path):
    np.save(tmp_path / "short.npy", np.arange(40, dtype=np.uint16))
    cfg = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), seq_len=T, val_fraction=0.25,
                     sources=f"tokens:{tmp_path}/short.npy@1")
    with pytest.raises(ValueError) as e:
        prepare_mixture(cfg, 300)
    assert str(e.value) == "source s0: the val split has 10 tokens, fewer than one sequence of data.seq_len + 1 (17)"
    (tmp_path / "p").mkdir()
    write_dataset(tmp_path / "p" / "data", [np.arange(100)])
    (tmp_path / "p" / "manifest.json").write_text('{"tokenizer": "sha256:abc"}')
    cfg.sources = f"megatron:{tmp_path}/p@1"
    with pytest.raises(ValueError) as e:
        prepare_mixture(cfg, 300)
    assert str(e.value) == (f"data.sources s0: {tmp_path}/p was prepared with tokenizer sha256:abc, "
                            "this run's data.tokenizer is bytes")


def test_raw_uint32_token_file_with_eos_documents(tmp_path):
    ids = np.tile(np.array([70000, 5, 6, 9, 7, 9], dtype=np.uint32), 20)  # EOS 9 ends each document
    ids.tofile(tmp_path / "raw.bin")
    cfg = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), seq_len=6, val_fraction=0.2,
                     sources=json.dumps([{"kind": "tokens", "path": f"{tmp_path}/raw.bin", "dtype": "uint32",
                                          "eos_id": 9, "weight": 1}]))
    data = MixtureData(prepare_mixture(cfg, 100_000), document_mask=True)
    assert data.num_tokens("train") == 96 and data.num_tokens("val") == 24
    win = data.locate("train", range(5), 6)[1]
    inputs, labels, docs = data.get("train", range(5), 6)
    assert inputs.tolist() == [[70000, 5, 6, 9, 7, 9]] * 5 and labels[:, -1].tolist() == [70000] * 5
    assert docs.tolist() == [[0, 0, 0, 0, 1, 1]] * 5 and sorted(win.tolist()) == sorted(set(win.tolist()))
