"""LoRA end to end through the command line: ``ndtrain train --finetune.lora_rank=4`` from a
Hugging Face folder (``checkpoint.init_weights_from``) on 2 processes under tp=2, then
``ndtrain convert --merge-lora`` and ``--to-peft``.

References: the checkpoint's base weights are the Hugging Face folder's, bitwise (frozen); the
merged checkpoint's logits equal the unmerged model's to 1e-6 relative (float32); ``peft`` loading
the exported adapters onto the same Hugging Face folder gives the unmerged model's logits to 1e-5
absolute (float32, the same operations in another order).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ndtrain.cli.commands import main
from ndtrain.model import lora
from ndtrain.train.rundir import RunDir, build_empty_model, load_state_into
from tests.corpus import source_text

pytestmark = pytest.mark.slow  # two ranks started through the CLI, ~80 s on a loaded 2-core machine
ROOT = Path(__file__).resolve().parents[2]
TARGETS = "*.wq,*.wv,*.wo,*.w2"


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(tmp folder, HF base folder, LoRA run dir) after 6 steps under tp=2."""
    transformers = pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("lora")
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)  # the debug preset's model, which the run trains (init_weights_from checks shapes only)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp / "hf_base")
    (tmp / "corpus.txt").write_text(source_text(40000))
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", "2",
           "--run-dir", str(run_dir), "--parallel.tp=2", "--training.steps=6", "--checkpoint.every=6",
           "--training.sample_tokens=0", "--training.eval_every=0", "--training.lr=0.01",
           f"--checkpoint.init_weights_from={tmp / 'hf_base'}", "--finetune.lora_rank=4",
           f"--finetune.lora_targets={TARGETS}", f"--data.source={tmp / 'corpus.txt'}",
           f"--data.cache_dir={tmp / 'cache'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_COLOR="1")
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, tmp / "hf_base", run_dir


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_base_is_the_hf_folder_and_merged_checkpoint_matches(finetuned, capsys):
    from ndtrain.hf.folder import load_hf_checkpoint

    tmp, hf_dir, run_dir = finetuned
    run = RunDir.open(run_dir)
    model, step = run.load_model(merge_lora=False)
    assert step == 6
    sd = model.state_dict()
    _, base = load_hf_checkpoint(hf_dir, "cpu", torch.float32)
    assert all(torch.equal(sd[k], v) for k, v in base.state_dict().items())  # frozen, bitwise
    assert sorted(k for k in sd if lora.is_adapter(k)) == sorted(
        f"layers.{i}.{m}.lora_{x}" for i in range(2) for m in ("attention.wq", "attention.wv", "attention.wo",
                                                                "feed_forward.w2") for x in "AB")
    assert min(sd[k].abs().max() for k in sd if k.endswith("lora_B")) > 1e-4  # trained off zero
    rc, out, err = _cli(capsys, "convert", "--merge-lora", run_dir, "--out", tmp / "merged")
    assert rc == 0 and "adapters merged" in out, err
    merged_cfg = RunDir.open(run_dir).cfg
    merged_cfg.finetune.lora_rank = 0
    merged = build_empty_model(merged_cfg)
    load_state_into(merged, tmp / "merged")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs, plain = model(ids), merged.eval()(ids), base(ids)
    assert (ours - plain).abs().max() > 1e-4  # the adapters change the logits
    assert (theirs - ours).abs().max() <= 1e-6 * ours.abs().max()
    rc, _, err = _cli(capsys, "convert", "--merge-lora", tmp / "hf_base", "--out", tmp / "x")
    assert rc == 2 and len(err.strip().splitlines()) == 1


def test_peft_loads_the_exported_adapters(finetuned, capsys):
    tmp, hf_dir, run_dir = finetuned
    rc, _, err = _cli(capsys, "convert", "--run-dir", run_dir, "--to-peft", tmp / "peft")
    assert rc == 0, err
    assert (tmp / "peft" / "adapter_config.json").is_file()
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'ndtrain[dev]')")
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, tmp / "peft").eval()
    model, _ = RunDir.open(run_dir).load_model(merge_lora=False)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(ids), tuned(ids).logits
    with torch.no_grad(), tuned.disable_adapter():  # PEFT wrapped ``base`` in place
        plain = tuned(ids).logits
    assert (ours - plain).abs().max() > 1e-4
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
