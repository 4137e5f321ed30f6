"""Data pipeline: corpus sources, tokenizers, cached token shards, and the global batch sampler."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ndtrain.config import DataConfig
from ndtrain.data import (
    GlobalBatchSampler,
    TokenData,
    iter_documents,
    load_tokenizer,
    local_slice,
    prepare_data,
    val_batches,
)
from ndtrain.data import shards as shards_mod
from ndtrain.data import tokenizer as tok_mod
from ndtrain.data.corpus import source_fingerprint
from ndtrain.data.tokenizer import open_tokenizer

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # café ünïcode {i}\n" for i in range(60)]


def _cfg(tmp_path: Path, source: str, **kw) -> DataConfig:
    return DataConfig(source=source, cache_dir=str(tmp_path / "cache"), **kw)


@pytest.fixture
def txt_dir(tmp_path):
    d = tmp_path / "txt"
    d.mkdir()
    for i, doc in enumerate(DOCS):
        (d / f"{i:03d}.txt").write_text(doc)
    return d


# ---------------------------------------------------------------- corpus sources

def test_txt_glob_dir_and_comma_list(tmp_path, txt_dir):
    assert list(iter_documents(_cfg(tmp_path, str(txt_dir / "*.txt")))) == DOCS
    assert list(iter_documents(_cfg(tmp_path, str(txt_dir)))) == DOCS
    two = f"{txt_dir / '000.txt'}, {txt_dir / '001.txt'}"
    assert list(iter_documents(_cfg(tmp_path, two))) == DOCS[:2]


def test_jsonl_and_parquet(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")
    assert list(iter_documents(_cfg(tmp_path, str(jl)))) == DOCS
    pqf = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": DOCS[:10] + [None], "n": list(range(11))}), pqf)
    assert list(iter_documents(_cfg(tmp_path, str(pqf), text_field="content"))) == DOCS[:10]
    both = _cfg(tmp_path, f"{jl},{pqf}", text_field="content")
    with pytest.raises(ValueError, match=r"a\.jsonl:1.*'content'"):
        list(iter_documents(both))
    with pytest.raises(ValueError, match=r"b\.parquet.*no column 'text'"):
        list(iter_documents(_cfg(tmp_path, str(pqf))))
    with pytest.raises(ValueError, match=r"b\.parquet.*no column 'text'"):  # raised through BPE training
        prepare_data(_cfg(tmp_path, str(pqf)), 300)


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="nothing-here.*matched no files"):
        list(iter_documents(_cfg(tmp_path, str(tmp_path / "nothing-here*.txt"))))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    with pytest.raises(ValueError, match="bad.txt"):
        list(iter_documents(_cfg(tmp_path, str(bad))))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="broken.parquet"):
        list(iter_documents(_cfg(tmp_path, str(broken))))


def test_stdlib_source_cap_and_fingerprint(tmp_path):
    cfg = _cfg(tmp_path, "stdlib", max_corpus_bytes=50_000)
    docs = list(iter_documents(cfg))
    assert sum(len(d.encode()) for d in docs) <= 50_000
    assert sum(len(d.encode()) for d in docs) > 49_000
    assert docs == list(iter_documents(cfg))  # deterministic order
    assert source_fingerprint(cfg) == source_fingerprint(cfg)
    assert source_fingerprint(cfg) != source_fingerprint(_cfg(tmp_path, "stdlib", max_corpus_bytes=60_000))


def test_fingerprint_tracks_file_changes(tmp_path, txt_dir):
    cfg = _cfg(tmp_path, str(txt_dir))
    fp = source_fingerprint(cfg)
    (txt_dir / "000.txt").write_text(DOCS[0] + "more text")
    assert source_fingerprint(cfg) != fp


# ---------------------------------------------------------------- tokenizers

def test_bytes_tokenizer_round_trip(tmp_path):
    tok = load_tokenizer(_cfg(tmp_path, "stdlib", tokenizer="bytes"), 257)
    text = "héllo, 世界\n\tdef f(): pass"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.eos_id == 256 and tok.vocab_size == 257
    assert tok.decode(ids) == text
    arr = tok.encode_docs(["ab", "", "é"])
    assert arr.tolist() == [97, 98, 256, 256, 0xC3, 0xA9, 256]
    with pytest.raises(ValueError, match=r"257.*vocab_size \(256\)"):
        load_tokenizer(_cfg(tmp_path, "stdlib", tokenizer="bytes"), 256)


def test_bpe_train_cache_hit_and_tokenizer_json(tmp_path, txt_dir, monkeypatch):
    cfg = _cfg(tmp_path, str(txt_dir), val_fraction=0.1)
    path = prepare_data(cfg, 300)
    data = TokenData(path)
    tok = data.tokenizer
    assert tok.vocab_size <= 300 and tok.decode(tok.encode(DOCS[3])) == DOCS[3]
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    meta_mtime = (path / "meta.json").stat().st_mtime_ns

    # second call: neither trains nor tokenizes
    def boom(*a, **k):
        raise AssertionError("cache miss")
    monkeypatch.setattr(tok_mod, "train_bpe", boom)
    monkeypatch.setattr(shards_mod, "_write_shards", boom)
    assert prepare_data(cfg, 300) == path
    assert (path / "meta.json").stat().st_mtime_ns == meta_mtime
    monkeypatch.undo()

    # a saved tokenizer.json loads from its path and gives the same ids
    tj = tmp_path / "hf" / "tokenizer.json"
    tj.parent.mkdir()
    tok.save(tj)
    tok2 = load_tokenizer(_cfg(tmp_path, str(txt_dir), tokenizer=str(tj)), 300)
    assert tok2.encode(DOCS[5]) == tok.encode(DOCS[5]) and tok2.eos_id == tok.eos_id
    with pytest.raises(ValueError, match=rf"{tok.vocab_size} ids.*vocab_size \(100\)"):
        load_tokenizer(_cfg(tmp_path, str(txt_dir), tokenizer=str(tj)), 100)
    p2 = prepare_data(_cfg(tmp_path, str(txt_dir), tokenizer=str(tj), val_fraction=0.1), 300)
    assert TokenData(p2).tokenizer.encode(DOCS[1]) == tok.encode(DOCS[1])


def test_tokenizer_json_without_eos_uses_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tj = tmp_path / "tokenizer.json"
    t.save(str(tj))
    with pytest.raises(ValueError, match="data.eos_id"):
        open_tokenizer(str(tj))
    assert open_tokenizer(str(tj), vocab_size=26, eos_id=25).eos_id == 25
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "z"}}))
    assert open_tokenizer(str(tmp_path)).eos_id == 25  # folder path + tokenizer_config eos


def test_bpe_vocab_too_small(tmp_path, txt_dir):
    with pytest.raises(ValueError, match=r"257.*vocab_size \(200\)"):
        prepare_data(_cfg(tmp_path, str(txt_dir)), 200)


# ---------------------------------------------------------------- shards

def test_prepare_stdlib_bpe_labels_shifted(tmp_path):
    cfg = _cfg(tmp_path, "stdlib", max_corpus_bytes=300_000)
    data = TokenData(prepare_data(cfg, 512))
    meta = data.meta
    assert meta["dtype"] == "uint16" and meta["tokenizer_vocab_size"] <= 512
    n_train, n_val = meta["num_tokens"]["train"], meta["num_tokens"]["val"]
    assert abs(n_val - 0.02 * (n_train + n_val)) <= 1
    T = 32
    n = data.num_sequences("train", T)
    assert n == (n_train - 1) // T
    x, y, docs = data.get("train", [0, 3, n - 1], T)
    assert docs is None  # data.document_mask off
    assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    flat = torch.from_numpy(data.tokens("train").astype("int64"))
    assert torch.equal(x[1], flat[3 * T:4 * T]) and torch.equal(y[1], flat[3 * T + 1:4 * T + 1])
    assert int(y[2, -1]) == int(flat[n * T])  # last window reaches the final label token
    with pytest.raises(IndexError):
        data.get("train", [n], T)
    assert data.tokenizer.decode(x[0].tolist()) in "".join(iter_documents(cfg))


def test_uint32_for_large_vocab(tmp_path, txt_dir):
    data = TokenData(prepare_data(_cfg(tmp_path, str(txt_dir), tokenizer="bytes"), 70_000))
    assert data.meta["dtype"] == "uint16"  # dtype follows the tokenizer's ids, not the model rows
    tok = load_tokenizer(_cfg(tmp_path, str(txt_dir), tokenizer="bytes"), 70_000)
    tok.vocab_size = 70_000  # pretend a large vocabulary
    out = tmp_path / "big"
    out.mkdir()
    meta = shards_mod._write_shards(_cfg(tmp_path, str(txt_dir), val_fraction=0.1), tok, out)
    assert meta["dtype"] == "uint32"
    assert (out / "val.bin").stat().st_size == 4 * meta["num_tokens"]["val"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path, txt_dir, monkeypatch):
    cfg = _cfg(tmp_path, str(txt_dir), tokenizer="bytes")
    real = tok_mod.ByteTokenizer.encode_docs
    calls = []

    def flaky(self, texts):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("tokenizer crashed")
        return real(self, texts)
    monkeypatch.setattr(tok_mod.ByteTokenizer, "encode_docs", flaky)
    with pytest.raises(RuntimeError, match="crashed"):
        prepare_data(cfg, 257)
    shard_root = tmp_path / "cache" / "shards"
    assert list(shard_root.iterdir()) == []  # no temp folder, no final folder
    path = prepare_data(cfg, 257)  # a retry succeeds
    assert sorted(os.listdir(shard_root)) == [path.name]
    assert sorted(os.listdir(path)) == ["meta.json", "train.bin", "val.bin"]
    # train + val is the whole stream, each document followed by EOS (256); val is the tail
    data = TokenData(path)
    stream = data.tokens("train").tolist() + data.tokens("val").tolist()
    assert stream == sum((list(d.encode()) + [256] for d in DOCS), [])
    assert data.num_tokens("val") == round(0.02 * len(stream))


def test_lost_race_keeps_winner(tmp_path, txt_dir, monkeypatch):
    """A process whose rename loses to an already published folder returns that folder."""
    cfg = _cfg(tmp_path, str(txt_dir), tokenizer="bytes")
    path = prepare_data(cfg, 257)
    before = (path / "meta.json").read_text(), path.stat().st_ino
    real_isfile = Path.is_file
    first = []

    def miss_once(self):  # make the first cache check miss, as if the winner was not done yet
        if self.name == "meta.json" and not first:
            first.append(1)
            return False
        return real_isfile(self)
    monkeypatch.setattr(Path, "is_file", miss_once)
    assert prepare_data(cfg, 257) == path
    assert ((path / "meta.json").read_text(), path.stat().st_ino) == before
    assert sorted(os.listdir(path.parent)) == [path.name]


# ---------------------------------------------------------------- sampler

def test_dp_slices_disjoint_and_cover_global():
    s = GlobalBatchSampler(100, 8, seed=1)
    g = s.next_global()
    parts = [local_slice(g, r, 2) for r in range(2)]
    assert set(parts[0]).isdisjoint(parts[1]) and parts[0] + parts[1] == g
    assert len(set(g)) == 8
    with pytest.raises(ValueError, match="not divisible"):
        local_slice(g, 0, 3)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_stream_identical_for_any_dp(dp):
    ref = GlobalBatchSampler(50, 8, seed=3)
    expected = [ref.next_global() for _ in range(10)]
    samplers = [GlobalBatchSampler(50, 8, seed=3) for _ in range(dp)]
    for step in range(10):
        locals_ = [smp.next_local(r, dp) for r, smp in enumerate(samplers)]
        assert sum(locals_, []) == expected[step]


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 4), (4, 1)])
def test_resume_with_other_dp(dp_before, dp_after):
    ref = GlobalBatchSampler(37, 8, seed=5)
    stream = [ref.next_global() for _ in range(12)]
    s = GlobalBatchSampler(37, 8, seed=5)
    for _ in range(5):
        s.next_local(0, dp_before)
    sd = json.loads(json.dumps(s.state_dict()))  # survives serialization
    assert sd == {"consumed": 40, "seed": 5, "global_batch_size": 8}
    s2 = GlobalBatchSampler(37, 8, seed=999)
    s2.load_state_dict(sd)
    for step in range(5, 12):
        g = s2.next_global()
        assert g == stream[step] == ref.peek(step)
        assert sum((local_slice(g, r, dp_after) for r in range(dp_after)), []) == g


def test_epoch_wrap_around():
    s = GlobalBatchSampler(10, 4, seed=0)
    stream = sum((s.next_global() for _ in range(5)), [])  # 20 items = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # each epoch reshuffled
    assert s.peek(2) == stream[8:12]  # batch 2 spans epochs 0 and 1
    assert s.epoch == 2 and s.step == 5
    big = GlobalBatchSampler(3, 7, seed=0)  # G > N: one batch spans several epochs
    b = big.next_global()
    assert len(b) == 7 and sorted(b[:3]) == [0, 1, 2] and sorted(b[3:6]) == [0, 1, 2]


def test_val_batches_fixed_order():
    assert list(val_batches(10, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(val_batches(10, 4, num_batches=3, dp_rank=1, dp_size=2)) == [[2, 3], [6, 7], [0, 1]]
    assert list(val_batches(3, 4)) == [[0, 1, 2, 0]]
    with pytest.raises(ValueError, match="no sequence"):
        list(val_batches(0, 4))
