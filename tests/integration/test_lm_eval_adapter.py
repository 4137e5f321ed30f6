"""lm-evaluation-harness against an ndtrain run directory (``ndtrain.cli.lm_eval_run``), with tasks
defined on local files (the harness's ``json`` loader on a JSONL file: no download).

References: the harness's requests, answered by the adapter, equal ``ndtrain eval --tasks
--details`` on the same examples request by request (log-likelihoods exactly: the same code on the
same model; the harness's accuracies equal ndtrain's); ``loglikelihood_rolling`` equals the sum over
the harness's own rolling windows (``lm_eval.utils.get_rolling_token_windows``) scored as plain
continuations, on a text three times ``max_seq_len`` long.
"""
from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install "
                                                "'ndtrain[lm-eval]')")

from ndtrain.cli.commands import main
from tests.eval_run import MAX_LEN, tiny_run_dir

pytestmark = pytest.mark.slow  # importing the harness and its datasets stack alone takes ~20 s

MC = [{"context": "def foo(self", "choices": ["):", " banana split", "ZZ"], "answer": 0},
      {"context": "import", "choices": [" os", " qqqqqqqqq"], "answer": 0},
      {"context": "return ", "choices": ["None", "!!", "x"], "answer": 2},  # trailing space moves over
      {"context": "class A", "choices": ["(object):", ":"], "answer": 1}]
GEN = [{"context": "def ", "target": "f", "stop": ["e"]}, {"context": "import ", "target": "o", "stop": ["\n"]}]


def _yaml(name: str, data, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\ndoc_to_text: \"{{{{context}}}}\"\n{body}")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm_eval")
    run_dir = tiny_run_dir(tmp)
    for name, rows in (("mc", MC), ("gen", GEN)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(_yaml("nd_mc", tmp / "mc.jsonl",
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "target_delimiter: \"\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"))
    (tasks / "gen.yaml").write_text(_yaml("nd_gen", tmp / "gen.jsonl",
        "output_type: generate_until\ndoc_to_target: \"{{target}}\"\ntarget_delimiter: \"\"\n"
        "generation_kwargs:\n  until: [\"e\"]\n  max_gen_toks: 32\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"))
    with pytest.MonkeyPatch.context() as mp:  # no network: the local JSONL files are all it reads
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp / "hf_cache"))
        from lm_eval.tasks import TaskManager

        from ndtrain.cli.lm_eval_run import NdtrainRunLM

        lm = NdtrainRunLM(str(run_dir))
        res = lm_eval.simple_evaluate(model=lm, tasks=["nd_mc", "nd_gen"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks)))
    return tmp, run_dir, lm, res


def _ndtrain(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["eval", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def test_loglikelihoods_equal_ndtrain_eval(harness, capsys):
    tmp, run_dir, _, res = harness
    ours = _ndtrain(capsys, "--tasks", tmp / "mc.jsonl", "--details", run_dir)["tasks"]["mc"]
    samples = sorted(res["samples"]["nd_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC)
    for s, d in zip(samples, ours["details"]):
        assert [r[0][0] for r in s["resps"]] == d["loglikelihoods"]
    assert res["results"]["nd_mc"]["acc,none"] == ours["acc"]
    assert res["results"]["nd_mc"]["acc_norm,none"] == ours["acc_norm"]


def test_generation_equals_ndtrain_eval(harness, capsys):
    tmp, run_dir, _, res = harness
    rows = [dict(r, stop=["e"], max_new_tokens=32) for r in GEN]  # the YAML's generation_kwargs
    (tmp / "gen_same.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours = _ndtrain(capsys, "--tasks", tmp / "gen_same.jsonl", "--details", run_dir)["tasks"]["gen_same"]
    samples = sorted(res["samples"]["nd_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == [d["output"] for d in ours["details"]]
    assert any(d["output"] for d in ours["details"])  # text to compare, not empty strings
    assert res["results"]["nd_gen"]["exact_match,none"] == ours["exact_match"]


def test_rolling_loglikelihood_equals_the_harness_windows(harness):
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from ndtrain.inference.tasks import loglikelihood_tokens

    _, _, lm, _ = harness
    text = ("for i in range(10):\n    print(i)\n" * 3)[:3 * MAX_LEN]
    ids = lm.tok.encode(text)
    want = 0.0
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
            ids, prefix_token=lm.tok.eos_id, max_seq_len=MAX_LEN, context_len=1)):
        want += loglikelihood_tokens(lm.model, ctx, cont)[0]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert got[0] == pytest.approx(want, abs=1e-9, rel=0) and len(ids) == 3 * MAX_LEN
