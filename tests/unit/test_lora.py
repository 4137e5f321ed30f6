"""LoRA on one process (``ndtrain.model.lora``, ``ndtrain.parallel.lora``): validation rules, target
errors, the frozen base, optimizer memory, merging."""
from __future__ import annotations

import math

import pytest
import torch

from ndtrain.config import ConfigError
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model, lora
from ndtrain.train.loop import Trainer
from tests.parallel.layout_parity import global_batch
from tests.utils import tiny_config

LORA = {"finetune.lora_rank": 4, "finetune.lora_alpha": 8.0}


@pytest.mark.parametrize("over, match", [
    ({"finetune.lora_rank": -1}, r"^finetune.lora_rank \(-1\) must be >= 0 \(0 = off\)$"),
    ({**LORA, "finetune.lora_alpha": 0.0}, r"^finetune.lora_alpha \(0.0\) must be > 0$"),
    ({**LORA, "finetune.lora_dropout": 1.0}, r"^finetune.lora_dropout \(1.0\) must be in \[0, 1\)$"),
    ({**LORA, "finetune.lora_targets": " , "}, r"^finetune.lora_targets is empty"),
    ({**LORA, "finetune.lora_dropout": 0.1, "parallel.tp": 2}, r"^finetune.lora_dropout > 0 needs tp == 1 \(got tp=2\)"),
    ({**LORA, "training.optimizer": "muon"}, r"needs training.optimizer=adamw \(got muon\)$"),
    ({**LORA, "training.local_sgd_steps": 2, "parallel.dp_replicate": 2}, r"excludes training.local_sgd_steps \(DiLoCo\)$"),
    ({**LORA, "parallel.tp": 2, "finetune.lora_targets": "*.wq,output"},
     r"^finetune.lora_targets matches the output head, which tp \(2\) splits by vocabulary"),
    ({**LORA, "training.fused_loss": True, "finetune.lora_targets": "output"},
     r"^finetune.lora_targets matches the output head, which training.fused_loss computes without it"),
    ({**LORA, "parallel.tp": 2, "model.n_kv_heads": 1},
     r"^finetune.lora_targets matches wk / wv, which tp \(2\) replicates \(n_kv_heads 1 < tp\)"),
])
def test_config_rejects_what_lora_does_not_support(over, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(over, world=2)


def test_targets_must_be_linears_and_match_something():
    cfg = tiny_config(LORA)
    model = build_model(cfg.model, torch.device("cpu"), torch.float64, 0)
    cfg.finetune.lora_targets = "*.wq,*.nothing"
    with pytest.raises(ValueError, match=r"^finetune.lora_targets: '\*.nothing' matches no module of this model"):
        lora.apply_lora(model, cfg.finetune, 0)
    cfg.finetune.lora_targets = "layers.0.attention"
    with pytest.raises(ValueError, match=r"^finetune.lora_targets: layers.0.attention \(Attention, matched by "
                                         r"'layers.0.attention'\) is not a bias-free linear"):
        lora.apply_lora(model, cfg.finetune, 0)


def test_init_is_kaiming_uniform_a_zero_b_and_depends_on_name_and_seed_only():
    a, b = lora.init_adapter("layers.0.attention.wq", 64, 32, 8, 7, torch.float64)
    assert a.shape == (8, 64) and b.shape == (32, 8) and not b.any()
    bound = 1 / math.sqrt(64)
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert torch.equal(a, lora.init_adapter("layers.0.attention.wq", 64, 32, 8, 7, torch.float64)[0])
    assert not torch.equal(a, lora.init_adapter("layers.1.attention.wq", 64, 32, 8, 7, torch.float64)[0])
    assert not torch.equal(a, lora.init_adapter("layers.0.attention.wq", 64, 32, 8, 8, torch.float64)[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frozen_base_and_optimizer_state_bytes(dtype):
    """3 AdamW steps: no base tensor changes by one bit, every adapter B moves off zero; the
    optimizer holds exp_avg + exp_avg_sq in float32 for the adapters only (8 bytes each); the
    adapters are the float32 masters, the frozen linear weights are stored in bf16 under bf16."""
    cfg = tiny_config({**LORA, "training.dtype": dtype, "finetune.lora_targets": "*.wq,*.wv,*.w2"}, world=1)
    tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    named = dict(tr.model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    for step in range(3):
        tr.step(*global_batch(step))
    adapters = {n: p for n, p in named.items() if lora.is_adapter(n)}
    n_adapter = sum(p.numel() for p in adapters.values())
    assert n_adapter == 2 * (4 * 32 + 32 * 4) + 2 * (4 * 32 + 16 * 4) + 2 * (4 * 48 + 32 * 4)
    assert [n for n, p in named.items() if not lora.is_adapter(n) and not torch.equal(p, before[n])] == []
    assert all(p.abs().max() > 0 for n, p in adapters.items() if n.endswith("lora_B"))
    moments = [t for st in tr.optimizer.state.values() for k, t in st.items() if k != "step"]
    assert sum(t.numel() * t.element_size() for t in moments) == n_adapter * 8
    assert {p.dtype for p in adapters.values()} == {torch.float32}
    low = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert named["layers.0.attention.wq.weight"].dtype == low and named["output.weight"].dtype == low
    assert named["tok_embeddings.weight"].dtype == torch.float32  # embeddings and norms are not autocast
    assert named["norm.weight"].dtype == torch.float32


def test_merged_logits_equal_unmerged():
    """W + s B A folded in place (``merge_lora``) and from a state dict (``merged_state``): the
    logits equal the adapted model's to 1e-6 (float32), and the adapters did change them."""
    cfg = tiny_config({**LORA, "finetune.lora_targets": "*.wq,*.wk,*.wv,*.wo,*.w1,*.w2,*.w3,output"})
    model = build_model(cfg.model, torch.device("cpu"), torch.float32, 0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids)
        lora.apply_lora(model, cfg.finetune, 0)
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
        adapted, sd = model(ids), {k: v.clone() for k, v in model.state_dict().items()}
        assert (adapted - plain).abs().max() > 1e-2
        assert lora.merge_lora(model) == 2 * 7 + 1
        merged = model(ids)
        assert not any(lora.is_adapter(n) for n in model.state_dict())
        fresh = build_model(cfg.model, torch.device("cpu"), torch.float32, 0)
        fresh.load_state_dict(lora.merged_state(sd, cfg.finetune.lora_alpha / cfg.finetune.lora_rank))
        from_sd = fresh(ids)
    assert (merged - adapted).abs().max() < 1e-6 * adapted.abs().max()
    assert torch.equal(from_sd, merged)


def test_reading_the_state_before_step_one_leaves_the_optimizer_fresh():
    """``checkpoint.init_weights_from`` reads ``tensor_state()`` as its template before step 1; the
    run must then take the same first steps as one that never read it (bitwise)."""
    cfg = tiny_config(LORA, world=1)
    runs = []
    for read_first in (False, True):
        tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
        if read_first:
            tr.tensor_state()
            assert not tr.optimizer.state
        for step in range(2):
            tr.step(*global_batch(step))
        runs.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_bad_targets_stop_the_launch_before_any_process(tmp_path, capsys):
    """The same rule before launch: ``ndtrain train`` exits 2 with the one line, and no run directory
    is made (the check builds the model on the meta device in the launching process)."""
    from ndtrain.cli.commands import main
    from ndtrain.cli.preflight import check_lora_targets

    cfg = tiny_config(LORA)
    cfg.finetune.lora_targets = "*.nothing"
    with pytest.raises(ConfigError, match=r"^finetune.lora_targets: '\*.nothing' matches no module"):
        check_lora_targets(cfg)
    run = tmp_path / "run"
    assert main(["train", "--config", "debug", "--run-dir", str(run), "--finetune.lora_rank=4",
                 "--finetune.lora_targets=*.attention"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("(Attention, matched by '*.attention') is not a bias-free linear LoRA can adapt")
    assert len(err) == 1 and not run.exists()
