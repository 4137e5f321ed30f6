"""Downstream tasks from local JSONL files (``ndtrain eval --tasks FILE``): multiple choice by
log-likelihood, generation by greedy decoding and exact match.

A task file holds one JSON object per line, all of one kind; the task's name is the file's stem:

    multiple choice  {"context": str, "choices": [str, ...], "answer": int}
    generation       {"context": str, "target": str | [str, ...], "stop": [str, ...],
                      "max_new_tokens": int}          (stop, max_new_tokens optional)

Scoring follows lm-evaluation-harness (Gao et al., "A framework for few-shot language model
evaluation"), so the two agree request by request (``ndtrain.inference.lm_eval_adapter``):

- a continuation c after a context x (``encode_pair``): trailing whitespace of x moves to c; the
  tokens of x + c are split after those of x; EOS comes first (the document boundary every training
  document follows). ``log p(c | x)`` sums the log-softmax (float64) of c's tokens; ``is_greedy``
  when each is the argmax. A sequence longer than ``max_seq_len + 1`` loses context from the left.
- ``acc``: the choice of highest ``log p`` is ``answer`` (the first on ties); ``acc_norm``: the same
  with ``log p`` divided by the choice's length in characters.
- generation: greedy tokens until EOS, ``max_new_tokens`` or ``max_seq_len``, cut before the first
  stop string; ``exact_match`` when the output, stripped, equals a target, stripped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ndtrain.data.tokenizer import Tokenizer
from ndtrain.inference.generate import TextStream, stream_tokens

DEFAULT_MAX_NEW_TOKENS = 32


@dataclass
class Task:
    """A task file read by ``load_task``: ``kind`` is "multiple_choice" or "generation"."""

    name: str
    kind: str
    examples: list[dict]


def load_task(path: str | Path) -> Task:
    """Read and check a task file (module docstring). Raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tasks {path}: no such file")
    examples, kinds = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        kinds.add(_check_example(ex, f"{path}:{n}"))
        examples.append(ex)
    if not examples:
        raise ValueError(f"{path}: no examples")
    if len(kinds) > 1:
        raise ValueError(f"{path}: mixes multiple-choice and generation examples; use one file per kind")
    return Task(path.stem, kinds.pop(), examples)


def _check_example(ex, where: str) -> str:
    if not isinstance(ex, dict) or not isinstance(ex.get("context"), str):
        raise ValueError(f"{where}: an example needs a string \"context\"")  # noqa: TRY004 (bad input, not a bug)
    if "choices" in ex:
        ch, ans = ex["choices"], ex.get("answer")
        if not (isinstance(ch, list) and ch and all(isinstance(c, str) and c for c in ch)):
            raise ValueError(f"{where}: \"choices\" must be a non-empty list of non-empty strings")
        if not (isinstance(ans, int) and 0 <= ans < len(ch)):
            raise ValueError(f"{where}: \"answer\" must be an index into \"choices\" (0..{len(ch) - 1})")
        return "multiple_choice"
    target = ex.get("target")
    if isinstance(target, str) or (isinstance(target, list) and target and all(isinstance(t, str) for t in target)):
        stop = ex.get("stop", [])
        if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"{where}: \"stop\" must be a list of non-empty strings")
        return "generation"
    raise ValueError(f"{where}: an example needs \"choices\" + \"answer\" (multiple choice) or "
                     "\"target\" (generation)")


def encode_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids led by EOS, continuation ids) as the module docstring splits them."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    ctx = tok.encode(stripped)
    whole = tok.encode(stripped + continuation)
    return [tok.eos_id] + ctx, whole[len(ctx):]


def _forward_logprobs(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """float64 (len(ids) - 1, V) log-softmax of the model's next-token logits after ids[:-1]."""
    device = model.rope_cos.device
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]], dtype=torch.long, device=device))[0]  # (T, V)
    return torch.log_softmax(logits.double(), dim=-1).cpu()


def loglikelihood_tokens(model: nn.Module, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """(log p(cont | ctx), greedy) for token lists; ``ctx`` is cut from the left to fit
    ``max_seq_len``. Raises ValueError for an empty ``cont`` or one longer than ``max_seq_len``."""
    limit = model.cfg.max_seq_len
    if not cont or len(cont) > limit:
        raise ValueError(f"a continuation of {len(cont)} tokens: need 1..max_seq_len ({limit})")
    ids = (ctx + cont)[-(limit + 1):]
    logp = _forward_logprobs(model, ids)[-len(cont):]  # (n_cont, V)
    target = torch.tensor(cont)
    picked = logp.gather(1, target[:, None])[:, 0]
    return float(picked.sum()), bool((logp.argmax(-1) == target).all())


def loglikelihood(model: nn.Module, tok: Tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """(log p(continuation | context), greedy) in nats (module docstring)."""
    return loglikelihood_tokens(model, *encode_pair(tok, context, continuation))


def rolling_loglikelihood(model: nn.Module, tok: Tokenizer, text: str) -> float:
    """log p(text) in nats after EOS, every token scored once: windows of ``max_seq_len``
    predictions, each token seeing as much preceding text as fits (``max_seq_len`` tokens)."""
    ids, limit = [tok.eos_id] + tok.encode(text), model.cfg.max_seq_len
    total = 0.0
    for start in range(1, len(ids), limit):
        end = min(start + limit, len(ids))
        window = ids[max(0, end - 1 - limit):end]  # inputs window[:-1] predict window[1:]
        logp = _forward_logprobs(model, window)[-(end - start):]
        total += float(logp.gather(1, torch.tensor(ids[start:end])[:, None]).sum())
    return total


def greedy_until(model: nn.Module, tok: Tokenizer, context: str, stop: list[str],
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> str:
    """Greedy text after ``context`` (led by EOS), ending at EOS, ``max_new_tokens``, the model's
    ``max_seq_len`` or a stop string; the text is cut before the first stop string."""
    limit = model.cfg.max_seq_len
    n_new = max(0, min(max_new_tokens, limit - 1))
    ids = ([tok.eos_id] + tok.encode(context))[-(limit - n_new):]
    text, stream = "", TextStream(tok.decode, ids)
    device = model.rope_cos.device
    for tid in stream_tokens(model, torch.tensor(ids, device=device), n_new, stop_ids=(tok.eos_id,)):
        if tid == tok.eos_id:
            break
        text += stream.push(tid)
        if any(s in text for s in stop):
            break
    text += stream.flush()  # a character held back at the end; past a stop string it is cut below
    cuts = [text.index(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def run_task(model: nn.Module, tok: Tokenizer, task: Task, details: bool = False) -> dict:
    """Metrics of ``task`` (module docstring): ``{"kind", "examples", "acc", "acc_norm", "correct",
    "correct_norm"}`` or ``{"kind", "examples", "exact_match", "correct"}``; with ``details`` a
    list of per-example results (log-likelihoods of every choice; the generated text)."""
    rows = []
    for ex in task.examples:
        if task.kind == "multiple_choice":
            ll = [loglikelihood(model, tok, ex["context"], c)[0] for c in ex["choices"]]
            norm = [v / len(c) for v, c in zip(ll, ex["choices"])]
            rows.append({"loglikelihoods": ll, "pred": int(np.argmax(ll)), "pred_norm": int(np.argmax(norm)),
                         "answer": ex["answer"]})
        else:
            out = greedy_until(model, tok, ex["context"], ex.get("stop", []),
                               ex.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
            targets = [ex["target"]] if isinstance(ex["target"], str) else ex["target"]
            rows.append({"output": out, "match": out.strip() in {t.strip() for t in targets}})
    n = len(rows)
    if task.kind == "multiple_choice":
        right = sum(r["pred"] == r["answer"] for r in rows)
        right_norm = sum(r["pred_norm"] == r["answer"] for r in rows)
        out = {"kind": task.kind, "examples": n, "acc": right / n, "acc_norm": right_norm / n,
               "correct": right, "correct_norm": right_norm}
    else:
        right = sum(r["match"] for r in rows)
        out = {"kind": task.kind, "examples": n, "exact_match": right / n, "correct": right}
    if details:
        out["details"] = rows
    return out
