"""After training, from the run directory alone: train ``debug`` 20 steps on
2 processes under tp=2 through the CLI, then ``generate``, ``eval`` and ``convert`` both ways.

References and tolerances:
* the end-of-run sample (gathered from the tp=2 ranks to rank 0) must equal a sample drawn, with
  the run's settings, from the single-process model loaded from the step-20 checkpoint: the same
  weights, the same seed, the same single-process computation (one thread everywhere);
* ``eval --batches training.eval_batches`` must reproduce the run's logged final ``val_loss``
  (same windows; tp=2 vs one process: float32 summation order only, so rel 1e-5);
* the Hugging Face export: transformers' ``LlamaForCausalLM`` logits vs ndtrain's single-process
  model on the same checkpoint, 1e-5 absolute in float32 on O(1) logits (the two compute the same
  operations in a different order); greedy continuations must be identical tokens;
* the import: the first fine-tuning loss from the converted checkpoint vs the loss of the
  transformers model on the same batch, 1e-5 (same weights, same float32 math up to order); after
  5 fine-tuning steps the loss on that batch is lower.

The corpus is a slice of the standard library's source, fixed for a Python install.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ndtrain.cli.commands import main
from ndtrain.config import load_config
from ndtrain.data import GlobalBatchSampler, TokenData, prepare_data
from ndtrain.inference.generate import generate
from ndtrain.train.metrics import read_metrics
from ndtrain.train.rundir import RunDir
from tests.corpus import source_text

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def train(model"


def _data_args(tmp: Path) -> list[str]:
    text = source_text(60000)  # independent of ndtrain's code (tests/corpus.py)
    (tmp / "corpus.txt").write_text(text)
    return [f"--data.source={tmp / 'corpus.txt'}", f"--data.cache_dir={tmp / 'cache'}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tp=2 run: (tmp folder, run dir, its console output, data override args). One thread
    here as in the ranks, so the single-process references compute what rank 0 computed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("after")
    data = _data_args(tmp)
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", "2",
           "--run-dir", str(run_dir), "--parallel.tp=2", "--checkpoint.every=10",
           "--training.sample_tokens=12", *data]
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_COLOR="1")
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    yield tmp, run_dir, out.stdout, data
    torch.set_num_threads(threads)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_dir_is_self_contained_and_sample_is_gathered(trained):
    tmp, run_dir, stdout, _ = trained
    run = RunDir.open(run_dir)
    assert run.cfg.parallel.tp == 2 and sorted(run.checkpoints()) == [10, 20]
    summary = json.loads((run_dir / "data_summary.json").read_text())
    prepared = TokenData(prepare_data(run.cfg.data, run.cfg.model.vocab_size))
    assert summary["bytes_read"] == len((tmp / "corpus.txt").read_bytes()) and not summary["truncated"]
    assert summary["train_tokens"] == prepared.num_tokens("train")
    assert summary["val_tokens"] == prepared.num_tokens("val")
    assert summary["epochs"] == pytest.approx(20 * 8 * 32 / summary["train_tokens"])
    # the run directory's tokenizer is the one the shards were made with
    text = "x = {'é': [1, 2]}  # ünïcode"
    assert run.tokenizer().encode(text) == prepared.tokenizer.encode(text)
    assert run.tokenizer().eos_id == prepared.tokenizer.eos_id == summary["eos_id"]
    # the end-of-run sample under tp=2 equals a sample of the single-process model of step 20
    t = run.cfg.training
    model, step = run.load_model()
    tok = run.tokenizer()
    ids = torch.tensor(tok.encode(t.sample_prompt))
    out = generate(model, ids, t.sample_tokens, t.sample_temperature, t.sample_top_k,
                   torch.Generator().manual_seed(t.seed))
    expected = tok.decode(out.tolist())
    assert step == 20 and len(out) == len(ids) + 12
    assert "skipped" not in stdout
    assert expected in stdout or repr(expected) in stdout, stdout[-1500:]


def test_generate_streams_greedy_and_seeded_samples(trained, capsys):
    _, run_dir, _, _ = trained
    run = RunDir.open(run_dir)
    tok = run.tokenizer()
    model, _ = run.load_model(10)
    rc, out, _ = _cli(capsys, "generate", "--run-dir", run_dir, "--checkpoint", 10, "--prompt", PROMPT,
                      "--max-new-tokens", 16, "--temperature", 0)
    greedy = generate(model, torch.tensor(tok.encode(PROMPT)), 16, stop_ids=(tok.eos_id,))
    assert rc == 0 and out == tok.decode(greedy.tolist()) + "\n"
    sampled = [_cli(capsys, "generate", "--run-dir", run_dir, "--prompt", PROMPT, "--max-new-tokens", 16,
                    "--temperature", 1.0, "--top-p", 0.9, "--seed", s)[1] for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    pf = run_dir.parent / "prompt.txt"
    pf.write_text(PROMPT)
    rc, from_file, _ = _cli(capsys, "generate", "--run-dir", run_dir, "--checkpoint", 10, "--prompt-file", pf,
                            "--max-new-tokens", 16, "--temperature", 0)
    assert rc == 0 and from_file == out


def test_eval_reproduces_logged_val_loss(trained, capsys):
    _, run_dir, _, _ = trained
    js = run_dir.parent / "eval.json"
    rc, out, _ = _cli(capsys, "eval", "--run-dir", run_dir, "--batches", 2, "--json", js)
    got = json.loads(out)
    assert rc == 0 and json.loads(js.read_text()) == got
    logged = [r["val_loss"] for r in read_metrics(run_dir) if r.get("step") == 20 and "val_loss" in r][-1]
    assert got["checkpoint_step"] == 20 and got["tokens"] == 2 * 8 * 32
    assert got["loss"] == pytest.approx(logged, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    # a byte-level BPE merges bytes: more bytes than tokens, so fewer bits per byte than per token
    assert got["bytes"] > got["tokens"]
    assert got["bits_per_byte"] == pytest.approx(got["loss"] * got["tokens"] / (math.log(2) * got["bytes"]))
    # a given corpus, tokenized with the run directory's tokenizer
    rc, out, _ = _cli(capsys, "eval", "--run-dir", run_dir, "--checkpoint", 10, "--data",
                      run_dir.parent / "corpus.txt", "--batches", 1)
    other = json.loads(out)
    assert rc == 0 and other["checkpoint_step"] == 10 and other["tokens"] == 8 * 32
    assert other["data"].endswith("corpus.txt") and math.isfinite(other["loss"]) and other["loss"] != got["loss"]


def test_convert_to_hf_loads_in_transformers(trained, capsys):
    transformers = pytest.importorskip("transformers")
    _, run_dir, _, _ = trained
    hf_dir = run_dir.parent / "hf"
    rc, _, err = _cli(capsys, "convert", "--run-dir", run_dir, "--to-hf", hf_dir, "--max-shard-bytes", 200_000)
    assert rc == 0, err
    assert (hf_dir / "model.safetensors.index.json").is_file()  # several shards
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    run = RunDir.open(run_dir)
    tok = run.tokenizer()
    model, _ = run.load_model()
    text = PROMPT + "):\n    return {'ünï': 1}"
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text and hf_tok.eos_token_id == tok.eos_id
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    prompt = torch.tensor(tok.encode(PROMPT))
    mine = generate(model, prompt, 16, stop_ids=(tok.eos_id,))
    with torch.no_grad():
        hf_out = hf.generate(prompt.view(1, -1), max_new_tokens=16, do_sample=False)
    assert hf_out[0].tolist() == mine.tolist()


def test_convert_from_hf_then_fine_tune(trained, capsys):
    transformers = pytest.importorskip("transformers")
    from ndtrain.train.loop import run as train_run

    tmp, _, _, data = trained
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp / "hf_llama")
    ck = tmp / "from_hf"
    rc, _, err = _cli(capsys, "convert", "--from-hf", tmp / "hf_llama", "--out", ck)
    assert rc == 0 and (ck / "meta.json").is_file(), err
    over = {a[2:].split("=")[0]: a.split("=", 1)[1] for a in data}
    over.update({"data.tokenizer": "bpe", "data.seq_len": 32, "training.steps": 5, "logging.log_every": 1,
                 "logging.plot": False, "training.global_batch_size": 8, "training.eval_batches": 1,
                 "training.sample_tokens": 4, "checkpoint.init_weights_from": str(ck), "checkpoint.every": 5})
    cfg = load_config(str(ck / "config.yaml"), over, world_size=1)
    path = prepare_data(cfg.data, cfg.model.vocab_size)
    rows = train_run(cfg, tmp / "finetune", path)
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5]
    data_ = TokenData(path)
    sampler = GlobalBatchSampler(data_.num_sequences("train", 32), 8, cfg.training.seed)
    inputs, labels, _ = data_.get("train", sampler.next_global(), 32)
    with torch.no_grad():
        ref = F.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten()).item()
    assert losses[1] == pytest.approx(ref, abs=1e-5)
    # it learned: the fine-tuned model's loss on the first step's batch (the same tokens as ``ref``)
    # is below the imported model's (losses of different steps' batches are not comparable)
    tuned, step = RunDir.open(tmp / "finetune").load_model()
    assert step == 5
    with torch.no_grad():
        after = F.cross_entropy(tuned(inputs).flatten(0, 1), labels.flatten()).item()
    assert after < ref - 1e-3, (after, ref)


def test_errors_are_one_line_exit_2(trained, capsys):
    tmp, run_dir, _, _ = trained
    cases = [("generate", "--run-dir", tmp / "missing"),
             ("eval", "--run-dir", run_dir, "--checkpoint", 7),
             ("convert", "--run-dir", tmp, "--to-hf", tmp / "x"),
             ("convert", "--from-hf", tmp / "missing", "--out", tmp / "y"),
             ("convert", "--run-dir", run_dir)]
    for argv in cases:
        rc, _, err = _cli(capsys, *argv)
        assert rc == 2 and len(err.strip().splitlines()) == 1, (argv, err)
    empty = tmp / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    rc, _, err = _cli(capsys, "generate", "--run-dir", empty)
    assert rc == 2 and "no checkpoint" in err
