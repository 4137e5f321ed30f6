"""Pieces of the after-training commands, single process: nucleus sampling,
streamed detokenisation, bytes per token, safetensors sharding, the transformers tokenizer files,
the data summary, and ``convert`` both ways for the MoE families (tensors must survive exactly)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ndtrain.config import DataConfig
from ndtrain.data.tokenizer import ByteTokenizer, HFTokenizer, save_tokenizer_files, train_bpe
from ndtrain.hf.common import shard_plan
from ndtrain.inference.evaluate import token_byte_lengths
from ndtrain.inference.generate import TextStream, _nucleus, sample_next

TEXT = "def f(x):\n    return {'é': x, \"ü\": '🙂'}  # naïve\n" * 3


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    support = {0.5: [1], 0.7: [1, 3], 0.8: [1, 3], 0.81: [1, 3, 2], 1.0: [1, 3, 2, 0]}
    for p, ids in support.items():
        kept = _nucleus(probs, p)[0]
        assert sorted(torch.nonzero(kept).flatten().tolist()) == sorted(ids), p
        assert torch.equal(kept[ids], probs[0, ids])  # surviving weights untouched
    g = torch.Generator().manual_seed(0)
    logits = probs.log()
    draws = {sample_next(logits, 1.0, top_p=0.7, generator=g).item() for _ in range(200)}
    assert draws == {1, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, top_p=0.0)


def test_text_stream_holds_back_partial_characters():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    stream = TextStream(tok.decode, ids[:3])
    pieces = [stream.push(i) for i in ids[3:]]
    assert "".join(pieces) + stream.flush() == TEXT[3:]
    assert "\ufffd" not in "".join(pieces)
    emoji_bytes = len("🙂".encode())
    start = TEXT.index("🙂")
    # the emoji's first three bytes emit nothing, the fourth emits the whole character
    at = len(TEXT[:start].encode()) - 3
    assert pieces[at:at + emoji_bytes] == ["", "", "", "🙂"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    tmp = tmp_path_factory.mktemp("bpe")
    (tmp / "c.txt").write_text(TEXT * 20)
    train_bpe(DataConfig(source=str(tmp / "c.txt")), 300, tmp / "tokenizer.json")
    return HFTokenizer(tmp / "tokenizer.json")


def test_token_byte_lengths_sum_to_utf8_size(bpe):
    for tok in (ByteTokenizer(), bpe):
        ids = tok.encode_docs([TEXT, TEXT[:17]])  # EOS after each: 0 bytes
        lengths = token_byte_lengths(tok, 320)
        assert len(ids) < len((TEXT + TEXT[:17]).encode()) or isinstance(tok, ByteTokenizer)
        assert int(lengths[ids].sum()) == len((TEXT + TEXT[:17]).encode())
        assert lengths[tok.eos_id] == 0 and lengths[300:].sum() == 0


def test_tokenizer_files_load_in_transformers(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    for i, tok in enumerate((ByteTokenizer(), bpe)):
        folder = tmp_path / str(i)
        save_tokenizer_files(tok, folder, 64)
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        assert hf(TEXT)["input_ids"] == tok.encode(TEXT)
        assert hf.decode(tok.encode(TEXT)) == TEXT
        assert hf.eos_token_id == tok.eos_id and hf.model_max_length == 64


def test_shard_plan_respects_the_limit():
    sd = {f"w{i}": torch.zeros(n) for i, n in enumerate([10, 30, 5, 100, 20, 20])}  # float32: 4 B each
    plan = shard_plan(sd, 160)
    assert sorted(k for shard in plan for k in shard) == sorted(sd)
    for shard in plan:
        size = sum(sd[k].numel() * 4 for k in shard)
        assert size <= 160 or len(shard) == 1  # w3 (400 B) alone
    assert len(plan) == 4 and shard_plan(sd, 10**6) == [sorted(sd)]


def test_corpus_bytes_and_truncation(tmp_path):
    from ndtrain.data.summary import corpus_bytes

    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT[:40])
    n = len(TEXT.encode()) + len(TEXT[:40].encode())
    cfg = DataConfig(source=str(tmp_path))
    assert corpus_bytes(cfg) == (n, False)
    assert corpus_bytes(DataConfig(source=str(tmp_path), max_corpus_bytes=n)) == (n, False)
    assert corpus_bytes(DataConfig(source=str(tmp_path), max_corpus_bytes=100)) == (100, True)


def _hf_models():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM

    yield "mixtral", MixtralForCausalLM(MixtralConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.2))
    yield "deepseek_v3", DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
        initializer_range=0.2))


def test_convert_round_trip_moe_families(tmp_path):
    """HF folder -> ``convert --from-hf`` -> a run directory holding that checkpoint -> ``convert
    --to-hf``: every tensor equal to the original's, and the tokenizer travels along."""
    pytest.importorskip("transformers")
    from ndtrain.cli.convert import from_hf, to_hf
    from ndtrain.hf.common import read_safetensors
    from ndtrain.train.rundir import RunDir

    torch.manual_seed(0)
    for family, hf in _hf_models():
        src, ck, run, out = (tmp_path / f"{family}_{n}" for n in ("src", "ck", "run", "out"))
        hf.save_pretrained(src)
        save_tokenizer_files(ByteTokenizer(), src, 64)
        from_hf(src, ck)
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(ck, run / "checkpoints" / "step_00000000")
        for name in ("config.yaml", "tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(ck / name, run / name)
        assert RunDir.open(run).cfg.model.is_moe
        to_hf(RunDir.open(run), out)
        before, after = read_safetensors(Path(src)), read_safetensors(out)
        assert sorted(after) == sorted(before), family
        for k, v in before.items():
            assert torch.equal(after[k], v), f"{family}: {k}"
        assert ByteTokenizer().encode(TEXT) == RunDir.open(run).tokenizer().encode(TEXT)


def test_sample_model_refuses_to_gather_a_huge_model(monkeypatch):
    """The end-of-run sample of a split layout gathers the weights to rank 0 only up to
    ``GATHER_LIMIT_BYTES``; past it the sample is skipped with a reason, before any collective."""
    from types import SimpleNamespace

    from ndtrain.config import load_config
    from ndtrain.model import Transformer
    from ndtrain.train import rundir

    cfg = load_config("debug")
    with torch.device("meta"):
        n_bytes = 4 * sum(p.numel() for p in Transformer(cfg.model).parameters())
    monkeypatch.setattr(rundir, "GATHER_LIMIT_BYTES", n_bytes - 1)
    tr = SimpleNamespace(plan=SimpleNamespace(sample_skip_reason="this layout splits the forward (tp)"))
    model, why = rundir.sample_model(tr, cfg)
    assert model is None and "GiB" in why and "ndtrain generate" in why
    monkeypatch.setattr(rundir, "gather_model", lambda trainer, c: "gathered")
    monkeypatch.setattr(rundir, "GATHER_LIMIT_BYTES", n_bytes)
    assert rundir.sample_model(tr, cfg) == ("gathered", "")
    alone = SimpleNamespace(plan=SimpleNamespace(sample_skip_reason=""), model="own")
    assert rundir.sample_model(alone, cfg) == ("own", "")


def test_folded_expert_tp_makes_rank_0_gather_before_sampling():
    """Experts split over a folded expert_tp under tp 1 need the other ranks for a forward: rank 0
    must not sample alone (it would wait in the expert_tp collective forever)."""
    from types import SimpleNamespace

    from ndtrain.mesh import ParallelDims
    from ndtrain.parallel.parallelize import sample_skip_reason

    cfg = SimpleNamespace(parallel=SimpleNamespace(zero_stage=0))
    folded = SimpleNamespace(dims=ParallelDims(dp_shard=2, expert_tp=2, world_size=2))
    plain = SimpleNamespace(dims=ParallelDims(dp_shard=2, world_size=2))
    assert "expert_tp" in sample_skip_reason(folded, cfg)
    assert sample_skip_reason(plain, cfg) == ""


def test_sample_tokens_zero_prints_and_gathers_nothing(monkeypatch, capsys):
    """``training.sample_tokens=0``: the end-of-run sample is off on every rank -- no gather, no
    line (it used to print the prompt alone); 1 or more samples as before."""
    from types import SimpleNamespace

    from ndtrain.config import load_config
    from ndtrain.train import loop

    calls = []
    monkeypatch.setattr(loop, "sample_model", lambda tr, c: calls.append(1) or (None, "a reason"))
    for n, printed in ((0, ""), (4, "sample: skipped (a reason)\n")):
        run = SimpleNamespace(cfg=load_config("debug", {"training.sample_tokens": str(n)}), trainer=None, rank=0)
        loop._sample(run, "sample", quiet=False)
        assert capsys.readouterr().out == printed
    assert calls == [1]
