"""``parallel.pp_layout``: the layout syntax (Megatron-LM's ``--pipeline-model-parallel-layout``), its
rules, the default balance with end stages that hold only the embedding / head, and Llama 3 405B's
126 layers over pp16 x v8 (first and last virtual stage without a block)."""
from __future__ import annotations

import pytest

from ndtrain.config import ConfigError, load_config
from ndtrain.parallel.pp.layout import (
    balanced_runs,
    check_layout,
    expand,
    format_layout,
    layout_runs,
    parse_layout,
)
from ndtrain.parallel.pp.rules import split_layers


def test_syntax_expands_repetitions_and_ignores_commas():
    assert expand("E(t|)*2,L") == "Et|t|L"
    assert expand("E t*3 | t, t L") == "Ettt|ttL"
    assert expand("((t|)*2t)*2") == "t|t|tt|t|t"
    # Megatron's DeepSeek-V3 example: 61 blocks and one MTP depth over pp16 x v2 = 32 stages
    stages = parse_layout("Et*3|(tt|)*29,m|L")
    assert len(stages) == 32 and stages[0] == "Ettt" and stages[-2:] == ["m", "L"]
    assert "".join(stages).count("t") == 61


@pytest.mark.parametrize("text, match", [
    ("E|t|x", "unknown token 'x' at position 4"),
    ("E|t*|L", "'\\*' at position 3 needs a count >= 1"),
    ("E|(t|)*0L", "needs a count >= 1"),
    ("*2E|tL", "'\\*' at position 0 repeats nothing"),
    ("E|(t|L", "a '\\(' is never closed"),
    ("E|t)|L", "'\\)' at position 3 closes no '\\('"),
])
def test_syntax_errors_name_the_token_and_its_position(text, match):
    with pytest.raises(ConfigError, match=match):
        expand(text)


@pytest.mark.parametrize("text, n_stages, n_layers, mtp, match", [
    ("E|t|tL", 4, 2, 0, "has 3 stages .* runs 4 virtual stages"),
    ("E|t|tL", 3, 3, 0, "places 2 transformer blocks .* model.n_layers is 3"),
    ("E||ttL", 3, 2, 0, "virtual stage 1 holds nothing"),
    ("tE|tL", 2, 2, 0, "'E' must appear once, first in virtual stage 0"),
    ("Et|E|tL", 3, 2, 0, "'E' must appear once"),
    ("Et|Lt", 2, 2, 0, "'L' must appear once, last in the last virtual stage"),
    ("Et|tmL", 2, 2, 2, "places 1 MTP depths .* model.mtp_depth is 2"),
    ("Et|tm|L", 3, 2, 1, "'m' must sit on the last virtual stage"),  # Megatron allows it; here not
    ("Et|mtL", 2, 2, 1, "a block 't' after 'm' / 'L'"),
    ("Et*3|(tt|)*29,m|L", 32, 61, 1, "'m' must sit on the last virtual stage"),
])
def test_layout_rules_name_what_failed(text, n_stages, n_layers, mtp, match):
    with pytest.raises(ConfigError, match=match):
        check_layout(text, n_stages, n_layers, mtp)


def test_layout_runs_and_format_round_trip():
    assert layout_runs("E|t*3|t|t,L", 4, 5) == [[], [0, 1, 2], [3], [4]]
    assert layout_runs("Et*2|t,mL", 2, 3, 1) == [[0, 1], [2]] == layout_runs("Et*2|tL", 2, 3, 1)  # m implied
    for runs, mtp in (([[], [0, 1, 2], [3], [4]], 0), ([[0], [1], [2], [3, 4]], 1), ([[0, 1, 2]], 0),
                      ([[]] + [[i] for i in range(126)] + [[]], 0)):
        text = format_layout(runs, mtp)
        assert layout_runs(text, len(runs), sum(map(len, runs)), mtp) == runs, text
    assert format_layout([[]] + [[i] for i in range(126)] + [[]]) == "E|(t|)*126,L"


def test_default_balance_is_the_even_split_where_there_are_enough_blocks():
    """Unchanged where each stage gets a block (existing layouts and checkpoints keep their split);
    one or two blocks fewer than stages: the embedding and then the head stand alone."""
    costs = [1.0] * 8
    for n_stages, emb, head in ((4, 0.0, 0.0), (4, 2.0, 2.0), (8, 0.5, 0.5), (3, 0.3, 0.1)):
        assert balanced_runs(costs, n_stages, emb, head) == split_layers(costs, n_stages, emb, head)
    assert balanced_runs([1.0] * 3, 4, 2.0, 2.0) == [[], [0], [1], [2]]
    assert balanced_runs([1.0] * 2, 4, 2.0, 2.0) == [[], [0], [1], []]
    with pytest.raises(ConfigError, match=r"n_layers \(2\) < pp \* pp_virtual_stages \(5\) - 2"):
        balanced_runs([1.0] * 2, 5)


def _cfg(preset: str, **par):
    return load_config(preset, {f"parallel.{k}": v for k, v in par.items()})


def test_llama3_405b_on_pp16_v8_is_accepted_and_split_as_llama3():
    """126 layers over 128 virtual stages, once rejected: the first chunk of rank 0 holds only the
    embedding, the last chunk of rank 15 only the head, every other chunk one block -- the split
    Llama 3 used (Llama 3, 2024, section 3.3.2), and the planner's."""
    from ndtrain.parallel.pp.stage import plan_stage, stage_runs
    from ndtrain.planner.model_spec import load_model_spec
    from ndtrain.planner.pipeline import split_stages

    cfg = _cfg("llama3_405b", pp=16, pp_schedule="interleaved", pp_virtual_stages=8, tp=8)  # validates
    runs = stage_runs(cfg, 128)
    assert runs == [[]] + [[i] for i in range(126)] + [[]]
    r0, r15 = plan_stage(cfg, 0), plan_stage(cfg, 15)
    assert r0.chunks[0] == [] and r0.chunks[1] == ["15"] and r0.first
    assert r15.chunks[7] == [] and r15.chunks[6] == ["110"] and r15.last
    spec, _ = load_model_spec("llama3_405b")
    assert [list(s) for s in split_stages(spec, 16, 8, "interleaved", cfg.data.seq_len)] == runs
    # the same split written as a layout
    explicit = _cfg("llama3_405b", pp=16, pp_schedule="interleaved", pp_virtual_stages=8, tp=8,
                    pp_layout="E|(t|)*126,L")
    assert stage_runs(explicit, 128) == runs


def test_validation_checks_the_layout_before_any_process():
    over = {"model.n_layers": 5, "parallel.pp": 2, "parallel.pp_schedule": "interleaved",
            "parallel.pp_virtual_stages": 2}
    cfg = load_config("debug", {**over, "parallel.pp_layout": "E|t*3|t*2|L"}, world_size=2)
    assert cfg.parallel.pp_layout == "E|t*3|t*2|L"
    with pytest.raises(ConfigError, match="places 4 transformer blocks"):
        load_config("debug", {**over, "parallel.pp_layout": "E|t*2|t*2|L"}, world_size=2)
    with pytest.raises(ConfigError, match="has 2 stages"):
        load_config("debug", {**over, "parallel.pp_layout": "Et*3|t*2L"}, world_size=2)
    with pytest.raises(ConfigError, match="has 2 stages"):  # pp = 1: one stage, the whole model
        load_config("debug", {"model.n_layers": 5, "parallel.pp_layout": "Et*3|t*2L"}, world_size=1)
    from ndtrain.parallel.pp.rules import inert_settings

    notes = inert_settings(1, "1f1b", 1, "Et*5L")  # printed before training
    assert len(notes) == 1 and "parallel.pp_layout=Et*5L has no effect with pp=1" in notes[0]
    # 5 blocks over 8 stages: more than the two end stages would be empty
    with pytest.raises(ConfigError, match=r"n_layers \(5\) < pp \* pp_virtual_stages \(8\) - 2"):
        load_config("debug", {**over, "parallel.pp_virtual_stages": 4}, world_size=2)


def test_rehearsal_roles_follow_the_layout():
    """``ndtrain rehearse`` takes its roles from the same stage plan: a stage with only the embedding."""
    from ndtrain.rehearsal.roles import rank_roles

    cfg = load_config("debug", {"model.n_layers": 5, "parallel.pp": 2, "parallel.pp_layout": "E|t*5,L"},
                      world_size=4)
    assert [(r.name, r.ranks_alike) for r in rank_roles(cfg, 4)] == [
        ("stage 0: blocks - + embedding", 2), ("stage 1: blocks 0-4 + head", 2)]
