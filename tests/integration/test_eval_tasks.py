"""``ndtrain eval --tasks``: accuracy on local task files against a count made by hand from the
model's own log-probabilities.

The reference is computed here without ``ndtrain.inference.tasks``: the run tokenizes raw bytes, so
a context and a choice are their UTF-8 bytes after the EOS id; one forward of the single-process
model over the whole sequence gives every log-softmax; a choice's log-likelihood is the sum over its
bytes (float64 of the float32 logits, so equality to 1e-9). Greedy generation is redone without the
KV cache (the full sequence every step). The counts of right answers then follow by hand.
"""
from __future__ import annotations

import json

import pytest
import torch

from ndtrain.cli.commands import main
from ndtrain.train.rundir import RunDir
from tests.eval_run import MAX_LEN, tiny_run_dir

MC = [  # context, choices (lengths differ, so acc and acc_norm can disagree), answer
    ("def foo(self", ["):", " banana split", "ZZ"], 0),
    ("import", [" os", " qqqqqqqqq"], 0),
    ("return", [" None", "!!", " x"], 2),
    ("class A", ["(object):", ":"], 1),
    ("", ["def", "}}}"], 0),  # empty context: the EOS alone conditions
    ("x" * 40, [" = 1", "yy"], 1),  # longer than max_seq_len: cut from the left
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tasks")
    return tmp, tiny_run_dir(tmp)


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)


def _hand_ll(model, eos: int, context: str, choice: str) -> float:
    ctx, cont = list(context.encode()), list(choice.encode())
    ids = ([eos] + ctx + cont)[-(MAX_LEN + 1):]
    lp = _logprobs(model, ids)
    return sum(float(lp[len(ids) - 1 - len(cont) + i, t]) for i, t in enumerate(cont))


def _hand_greedy(model, eos: int, context: str, n_new: int, stop: list[str]) -> str:
    ids = [eos] + list(context.encode())
    new = []
    for _ in range(n_new):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        if nxt == eos:
            break
        ids.append(nxt)
        new.append(nxt)
    text = bytes(t for t in new if t < 256).decode("utf-8", errors="replace")
    cuts = [text.index(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def _eval(capsys, *argv) -> tuple[int, dict | str]:
    capsys.readouterr()
    rc = main(["eval", *map(str, argv)])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else out.err)


def test_multiple_choice_accuracy_equals_a_hand_count(run, capsys):
    tmp, run_dir = run
    path = tmp / "mc.jsonl"
    path.write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in MC))
    model, _ = RunDir.open(run_dir).load_model()
    eos = RunDir.open(run_dir).tokenizer().eos_id
    hand = [[_hand_ll(model, eos, c, x) for x in ch] for c, ch, _ in MC]
    right = sum(max(range(len(ll)), key=lambda i: (ll[i], -i)) == a for ll, (_, _, a) in zip(hand, MC))
    right_norm = sum(max(range(len(ll)), key=lambda i: (ll[i] / len(ch[i]), -i)) == a
                     for ll, (_, ch, a) in zip(hand, MC))
    rc, out = _eval(capsys, "--tasks", path, "--details", run_dir)
    assert rc == 0, out
    res = out["tasks"]["mc"]
    assert out["checkpoint_step"] == 2 and res["kind"] == "multiple_choice" and res["examples"] == len(MC)
    for got, want in zip(res["details"], hand):
        assert got["loglikelihoods"] == pytest.approx(want, abs=1e-9, rel=0)
    assert (res["correct"], res["correct_norm"]) == (right, right_norm)
    assert res["acc"] == right / len(MC) and res["acc_norm"] == right_norm / len(MC)
    # the same through --run-dir, without details
    rc, again = _eval(capsys, "--run-dir", run_dir, "--tasks", path)
    assert rc == 0 and "details" not in again["tasks"]["mc"] and again["tasks"]["mc"]["acc"] == res["acc"]


def test_generation_exact_match_equals_a_hand_count(run, capsys):
    tmp, run_dir = run
    model, _ = RunDir.open(run_dir).load_model()
    eos = RunDir.open(run_dir).tokenizer().eos_id
    ctxs = ("def ", "import ")
    full = [_hand_greedy(model, eos, c, 8, []) for c in ctxs]
    stops = [[next(ch for ch in f[1:] if ch != "\ufffd")] for f in full]  # a character each does generate
    greedy = [_hand_greedy(model, eos, c, 8, s) for c, s in zip(ctxs, stops)]
    assert all(0 < len(g) < len(f) for g, f in zip(greedy, full)), (full, greedy)  # each cut by its stop
    rows = [{"context": "def ", "target": f"  {greedy[0]} ", "stop": stops[0], "max_new_tokens": 8},  # a match
            {"context": "import ", "target": greedy[1] + "#", "stop": stops[1], "max_new_tokens": 8},  # none
            {"context": "import ", "target": ["nope", greedy[1]], "stop": stops[1], "max_new_tokens": 8}]
    (tmp / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out = _eval(capsys, "--tasks", tmp / "gen.jsonl", "--details", run_dir)
    assert rc == 0, out
    res = out["tasks"]["gen"]
    assert [d["output"] for d in res["details"]] == [greedy[0], greedy[1], greedy[1]]
    assert (res["correct"], res["exact_match"]) == (2, 2 / 3)


@pytest.mark.parametrize("line, message", [
    ('{"context": "a", "choices": ["b"], "answer": 1}',
     'bad.jsonl:1: "answer" must be an index into "choices" (0..0)'),
    ('{"context": "a"}', 'bad.jsonl:1: an example needs "choices" + "answer" (multiple choice) or "target" (generation)'),
    ('{"context": 1, "target": "x"}', 'bad.jsonl:1: an example needs a string "context"'),
    ('not json', 'bad.jsonl:1: not JSON (Expecting value)'),
])
def test_bad_task_files_are_one_line_errors(run, capsys, line, message):
    tmp, run_dir = run
    (tmp / "bad.jsonl").write_text(line + "\n")
    rc, err = _eval(capsys, "--tasks", tmp / "bad.jsonl", run_dir)
    assert rc == 2 and err == f"ndtrain eval: {tmp / message}\n"


def test_task_flags_that_exclude_each_other(run, capsys):
    tmp, run_dir = run
    (tmp / "one.jsonl").write_text('{"context": "a", "target": "b"}\n')
    rc, err = _eval(capsys, "--tasks", tmp / "one.jsonl", "--batches", 1, run_dir)
    assert rc == 2 and err == ("ndtrain eval: --tasks scores task files; --data / --batches evaluate a "
                               "corpus (give one or the other)\n")
    rc, err = _eval(capsys, "--tasks", tmp / "one.jsonl", "--run-dir", tmp / "elsewhere", run_dir)
    assert rc == 2 and err == f"ndtrain eval: two run directories: --run-dir {tmp / 'elsewhere'} and {run_dir}\n"
