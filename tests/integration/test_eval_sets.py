"""``eval.sets``: named validation sets in the training loop, logged per set.

References: the same float64 run on one process and on two (tp=2) logs the same ``val_loss/NAME``
at every evaluation (1e-10: summation order only); a ``val`` set is the held-out ``val_loss``; a set
of other text gives another number; ``ndtrain eval --data SET --batches training.eval_batches`` on
the final checkpoint (its own windowing, ``ndtrain.inference.evaluate``, float32) reproduces the
last logged value to 1e-5 relative.
"""
from __future__ import annotations

import json

import pytest

from ndtrain.cli.commands import main
from ndtrain.cli.launch import launch
from ndtrain.config import ConfigError, load_config
from ndtrain.train.metrics import format_line, read_metrics
from tests.corpus import source_text


def _cfg(tmp, **over):
    text = source_text(40000)
    (tmp / "corpus.txt").write_text(text[:30000])
    (tmp / "other.txt").write_text(text[30000:31000])  # 1000 bytes: wraps within 2 batches
    return load_config("debug", {"data.source": str(tmp / "corpus.txt"), "data.cache_dir": str(tmp / "cache"),
                                 "training.steps": 2, "training.eval_every": 1, "data.tokenizer": "bytes", "training.dtype": "float64",
                                 "checkpoint.every": 2, "training.sample_tokens": 0, "logging.progress": "plain",
                                 "eval.sets": f"other={tmp / 'other.txt'}; held=val", **over})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalsets")
    launch(_cfg(tmp), tmp / "one", nproc=1)
    launch(_cfg(tmp, **{"parallel.tp": 2}), tmp / "tp2", nproc=2)
    return tmp, read_metrics(tmp / "one"), read_metrics(tmp / "tp2")


def test_sets_are_logged_per_set_and_match_one_process(runs):
    _, one, tp2 = runs
    evals = [r for r in one if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert [r["step"] for r in tp2 if "val_loss" in r] == [0, 1, 2]
    for a, b in zip(evals, (r for r in tp2 if "val_loss" in r)):
        for key in ("val_loss", "val_loss/other", "val_loss/held"):
            assert b[key] == pytest.approx(a[key], abs=1e-10, rel=0), (a["step"], key)
        assert a["val_loss/held"] == a["val_loss"]  # "val" is the held-out split itself
        assert abs(a["val_loss/other"] - a["val_loss"]) > 1e-3  # other text, another number
    assert "| val/other " in format_line(evals[-1]) and "| val/held " in format_line(evals[-1])


def test_ndtrain_eval_reproduces_a_set(runs, capsys):
    tmp, one, _ = runs
    capsys.readouterr()
    rc = main(["eval", "--run-dir", str(tmp / "one"), "--data", str(tmp / "other.txt"), "--batches", "2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["checkpoint_step"] == 2
    assert out["loss"] == pytest.approx(one[-1]["val_loss/other"], rel=1e-5)


@pytest.mark.parametrize("sets, message", [
    ("other", ("eval.sets entry 'other': expected NAME=SOURCE with NAME of letters, digits, '_', '.', '-' "
               "(entries separated by ';')")),
    ("a=val;a=x.txt", "eval.sets: the name 'a' is given twice"),
    ("bad name=val", ("eval.sets entry 'bad name=val': expected NAME=SOURCE with NAME of letters, digits, "
                      "'_', '.', '-' (entries separated by ';')")),
])
def test_malformed_sets_are_config_errors(tmp_path, sets, message):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, **{"eval.sets": sets})
    assert str(e.value) == message


def test_an_unreadable_set_fails_before_launch(tmp_path):
    cfg = _cfg(tmp_path, **{"eval.sets": f"gone={tmp_path / 'missing.txt'}"})
    with pytest.raises(ConfigError) as e:
        launch(cfg, tmp_path / "run", nproc=2)
    assert str(e.value).startswith("eval.sets gone: data.source: ") and "missing.txt" in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # two more 2-rank runs
@pytest.mark.parametrize("layout", [{"parallel.pp": 2}, {"parallel.dp_shard": 2, "parallel.zero_stage": 3}],
                         ids=["pp2", "zero3"])
def test_sets_match_one_process_under_pp_and_zero3(runs, layout):
    tmp, one, _ = runs
    run_dir = tmp / "_".join(f"{k.split('.')[1]}{v}" for k, v in layout.items())
    launch(_cfg(tmp, **layout), run_dir, nproc=2)
    theirs = [r for r in read_metrics(run_dir) if "val_loss" in r]
    ours = [r for r in one if "val_loss" in r]
    assert [r["step"] for r in theirs] == [r["step"] for r in ours]
    for a, b in zip(ours, theirs):
        for key in ("val_loss", "val_loss/other", "val_loss/held"):
            assert b[key] == pytest.approx(a[key], abs=1e-10, rel=0), (a["step"], key)


def test_a_set_is_tokenized_once_and_again_when_its_text_changes(tmp_path, monkeypatch):
    from ndtrain.config import DataConfig
    from ndtrain.data import TokenData, eval_sets
    from ndtrain.data.tokenizer import ByteTokenizer

    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "héllo"}\n{"text": "world"}\n')
    cfg, tok = DataConfig(cache_dir=str(tmp_path / "cache"), tokenizer="bytes"), ByteTokenizer()
    folder = eval_sets.prepare_eval_set(cfg, str(src), tok)
    assert TokenData(folder).tokens("val").tolist() == [*"héllo".encode(), 256, *b"world", 256]
    assert eval_sets.prepare_eval_set(cfg, "val", tok) is None
    with monkeypatch.context() as mp:
        mp.setattr(eval_sets, "_doc_chunks", lambda _cfg: pytest.fail("tokenized a cached set again"))
        assert eval_sets.prepare_eval_set(cfg, str(src), tok) == folder
    src.write_text('{"text": "other"}\n')
    again = eval_sets.prepare_eval_set(cfg, str(src), tok)
    assert again != folder and TokenData(again).tokens("val").tolist() == [*b"other", 256]
