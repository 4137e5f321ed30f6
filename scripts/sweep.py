"""Configuration sweep: validate the whole product, train what validates, write docs/compatibility.md.

    python scripts/sweep.py                  # full sweep (~15-20 min on 2 idle CPU cores), writes the doc
    python scripts/sweep.py --only "KEY"     # rerun one combination (key as printed), print only
    python scripts/sweep.py --match "moe |"  # every combination whose key contains the text
    python scripts/sweep.py --list           # validation only: each combination and its rule
    python scripts/sweep.py --from-json runs/sweep/results.json   # rewrite the doc, no training
    python scripts/sweep.py --resume         # resume sweep: each combination stopped and resumed
    python scripts/sweep.py --resume --match "dp_shard2 | zero1" --doc   # a slice, its doc section

The product and the checks are in ``ndtrain/tools/sweep.py`` (resume: ``ndtrain/tools/resume_sweep.py``);
process groups in ``ndtrain/tools/sweep_groups.py``. The resume sweep writes its own section of the doc
(``## Resume``) and, when ``runs/sweep/results.json`` exists, the ``resume`` column of the main table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ndtrain.tools import resume_sweep as RS
from ndtrain.tools import sweep as S
from ndtrain.tools.sweep import Combo
from ndtrain.tools.sweep_groups import Result

FAIL = ("mismatch", "error", "timeout", "crash", "nonfinite")
SYMBOL = {"pass": "✓", "runs": "~", "mismatch": "✗", "error": "E", "timeout": "T", "crash": "C",
          "nonfinite": "N"}


def _uses(c: Combo) -> set[str]:
    """The matrix columns a combination falls under."""
    p = dict(c.par)
    out = {"1 rank"} if c.world == 1 else set()
    out |= {ax for ax in ("dp_replicate", "dp_shard", "ep") if p.get(ax, 1) > 1}
    if p.get("cp", 1) > 1:
        out.add(f"cp {p['cp_impl']}")
    if p.get("tp", 1) > 1:
        out.add("tp+sp" if p.get("sequence_parallel") else "tp")
    if p.get("expert_tp", 1) > 1:
        out.add("expert_tp")
    if c.fused:
        out.add("fused loss")
    if p.get("pp", 1) > 1:
        out.add(f"pp {p['pp_schedule']}")
    out |= {f"ZeRO-{c.zero}", f"AC {c.ac}", c.dtype}
    return out


COLUMNS = ["1 rank", "dp_replicate", "dp_shard", "cp ring", "cp ulysses", "cp hybrid", "tp", "tp+sp",
           *[f"pp {s}" for s in S.PP_SCHEDULES], "ep", "expert_tp", "ZeRO-1", "ZeRO-2", "ZeRO-3",
           *[f"AC {a}" for a in S.AC_POLICIES[1:]], *S.DTYPES[1:], "fused loss"]


def rule_key(rule: str) -> str:
    return re.sub(r"\d+", "N", rule)


def run(combos: list[Combo], timeout_s: float, mode: str = "layout") -> list[Result]:
    """Validate every combination, train the valid ones (failures twice); one Result each."""
    results: list[Result] = []
    todo = []
    for c in combos:  # validation first: cheap, no processes
        rule = RS.check_resume(c) if mode == "resume" else S.check(c)
        if rule is None:
            todo.append(c)
        else:
            results.append(Result(c, "rejected", detail=rule))
    print(f"{len(combos)} combinations: {len(results)} rejected by validation, {len(todo)} to train",
          flush=True)
    n = [0]

    def log(r: Result) -> None:
        n[0] += 1
        print(f"[{n[0]}/{len(todo)}] {r.status:9s} {r.seconds:5.1f}s  {r.combo.key}"
              + (f"  -- {r.detail[:160]}" if r.status not in ("pass", "runs") else ""), flush=True)

    trained = _train(todo, timeout_s, log, mode)
    # Other work may change the code under a long sweep: a failure counts only if a fresh group
    # fails it again; one that then passes is kept as passing, with its first failure noted.
    again = [r.combo for r in trained if r.status in FAIL]
    if again:
        print(f"rerunning the {len(again)} failures on fresh groups", flush=True)
        n[0] = 0
        second = {r.combo: r for r in _train(again, timeout_s, log, mode)}
        for i, r in enumerate(trained):
            if r.combo in second:
                trained[i] = second[r.combo]
                trained[i].extra["first_try"] = f"{r.status}: {r.detail[:300]}"
    return results + trained


def _train(todo: list[Combo], timeout_s: float, log, mode: str = "layout") -> list[Result]:
    from ndtrain.tools.sweep_groups import run_group

    out = []
    for world in sorted({c.world for c in todo}):
        group = [c for c in todo if c.world == world]
        out += run_group(world, group, timeout_s * (2 if world == 8 else 1), log, mode)
    return out


def _cell(rs: list[Result], ids: dict[str, int]) -> str:
    ok = sum(r.status == "pass" for r in rs)
    runs = sum(r.status == "runs" for r in rs)
    bad = sum(r.status in FAIL for r in rs)
    rej = sorted({ids[rule_key(r.detail)] for r in rs if r.status == "rejected"})
    if bad:
        return f"**fails {bad}/{ok + runs + bad}**"
    if ok or runs:
        text = " ".join(x for x in (f"✓ {ok}" if ok else "", f"~ {runs}" if runs else "") if x)
        return text + (f" (R{','.join(map(str, rej))})" if rej else "")
    return "R" + ",".join(map(str, rej)) if rej else ""


HEADER = """# Compatibility: what composes with what

Generated by `python scripts/sweep.py` (do not edit by hand; rerun it): {date}, torch {torch},
Python {python}, {minutes:.1f} min on this machine.

Every combination of the product below is first validated as `ndtrain train` validates it (no
processes). A rejected one shows its rule (`R<n>`). A validated one is trained for {steps} optimizer
steps on a tiny model (dim 32, {layers} layers, vocab {vocab}, seq {seq}, global batch {batch},
microbatch 1, gradient clipping active) on gloo CPU ranks with fixed batches, and compared with the
single-process run of the same model config:

* **float64** (`✓`): the loss, the gradient norm and the MoE aux / MTP losses of every step, on every
  rank, equal the single-process values to {rtol:g} relative (a layout only reorders float64 sums,
  ~1e-14 seen; a real fault moves them by far more than 1e-6);
* **float32** (`✓`): the same values to {rtol32:g} relative (float32 roundoff: at most 3e-7 seen);
* **bfloat16 / float16** (`~`): only checked for running with a finite loss on every rank (their
  roundoff, ~1e-3 to 1e-2 here, is as large as the faults the sweep looks for);
* `✗` mismatch, `E` error (a rank raised), `T` timeout (hang), `C` crash (a rank died), `N`
  non-finite loss: see *Known failures*. Nothing is marked passing that was not run.

The product (`ndtrain.tools.sweep.enumerate_combos`): model features {full} x (a) every layout with
degrees in {{1, 2, 4}} of pp, dp_replicate, dp_shard, cp, tp on <= 4 ranks (both cp implementations, tp
with and without SP, each pp schedule, ep dividing dp_shard x cp; MoE also with expert_tp = tp
where there is no pp, and the folded expert meshes of `FOLDED`: ep spanning tp, expert_tp under tp 1) x ZeRO 0-3 on 1-2 ranks and on 4-rank layouts with ep or HSDP, ZeRO {{0, 3}} on
the other 4-rank layouts, and 8 layouts on 8 ranks x ZeRO {{0, 3}}; (b) {n_rep} representative
layouts x each activation-checkpointing policy x ZeRO {{0, 3}}; (c) the same {n_rep} layouts x
float32 / bfloat16 / float16 x ZeRO {{0, 3}}; (d) the same {n_rep} layouts x ZeRO {{0, 3}} with
`training.fused_loss`. Combined features ({combined}) run (a) on the {n_rep} representative layouts
x ZeRO 0-3 only. Model features: {features}. The default test suite runs the {n_subset}
combinations of `ndtrain.tools.sweep.SUBSET` (`tests/integration/test_sweep.py`).

Totals: {totals}.

## Model feature x axis

Each cell sums every combination of that feature that uses that axis value (with anything else):
`✓ n` n passed, `~ n` n ran (bfloat16 / float16), `fails k/n`, `R<n>` the rules that rejected the rest
(or all of them).
"""

# What the sweep's failures mean, by a pattern of their detail (written after reading them; the
# lead routes the fixes). Unmatched failures are listed without a note.
NOTES: dict[str, str] = {  # e.g. {r"^moe \| .*cp[24]": "why these fail, where to fix"}
}


def _feature_text() -> str:
    """Each feature with what it changes of the base model (first keys only)."""
    def short(over: dict) -> str:
        keys = [f"{k}={v}" for k, v in over.items() if not k.startswith(("mla_", "moe_z", "moe_bias"))]
        return ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    return "; ".join(f"`{f}` ({short(o) or 'base'})" for f, o in S.FEATURES.items())


def report(results: list[Result], seconds: float, out: Path, resume: tuple | None = None) -> None:
    """Write the doc; ``resume``: (results, seconds, combinations in the resume product) of the
    resume sweep, shown as the ``resume`` column and the ``## Resume`` section."""
    import torch

    ids: dict[str, int] = {}
    examples: dict[int, str] = {}
    counts: dict[int, int] = defaultdict(int)
    by_status: dict[str, int] = defaultdict(int)
    for r in results:
        by_status[r.status] += 1
        if r.status == "rejected":
            k = ids.setdefault(rule_key(r.detail), len(ids) + 1)
            examples.setdefault(k, r.detail)
            counts[k] += 1
    head = HEADER.format(
        date=datetime.date.today(), torch=torch.__version__, python=platform.python_version(),
        minutes=seconds / 60, steps=S.STEPS, layers=S.BASE_MODEL["n_layers"], vocab=S.V, seq=S.T,
        batch=S.G, rtol=S.RTOL, rtol32=S.TOLERANCE["float32"], features=_feature_text(),
        full=", ".join(S.FULL_PRODUCT), combined=", ".join(f for f in S.FEATURES if f not in S.FULL_PRODUCT),
        n_rep=len(S.REPRESENTATIVE), n_subset=len(S.SUBSET),
        totals=", ".join(f"{v} {k}" for k, v in sorted(by_status.items())))
    cols = COLUMNS + (["resume"] if resume else [])
    L = [head, "| feature | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for f in S.FEATURES:
        rs = [(r, _uses(r.combo)) for r in results if r.combo.feature == f]
        cells = [_cell([r for r, uses in rs if col in uses], ids) for col in COLUMNS]
        if resume:
            cells.append(_cell([r for r in resume[0] if r.combo.feature == f], ids))
        L.append(f"| {f} | " + " | ".join(cells) + " |")
    L += ["", "## Rules that reject combinations", "", "| id | rule (first example) | combinations |",
          "|---|---|---|"]
    L += [f"| R{k} | {examples[k]} | {counts[k]} |" for k in sorted(examples)]
    L += _failures(results)
    L += _per_combo(results, ids)
    L += resume_section(*resume) if resume else []
    out.write_text("\n".join(L) + "\n")
    print(f"wrote {out}")


RESUME_HEAD = """## Resume: stopped and resumed

Generated by `python scripts/sweep.py --resume{cmd}`: {date}, {minutes:.1f} min; {n_run} of the {n_all}
combinations of the resume product run{slice_note}.

Each combination that validates (the product above, plus DiLoCo, asynchronous saves and a moving
float16 loss scale, tier `resume`) trains {steps} steps and saves a checkpoint after step {stop} (DiLoCo
inside an outer interval: step 3) with the run loop's own save (asynchronous ones while training goes
on); then a fresh trainer of the **same layout** resumes it with the run loop's own resume and trains to
the end: its loss, gradient norm, lr, tokens, aux / MTP losses and loss scale of every step, and its
whole final state (weights, buffers such as the expert bias, AdamW moments and steps, DiLoCo anchor and
momentum), must equal the uninterrupted run's **bitwise**, in every dtype. A trainer of **one other
layout** of the same world size (`ndtrain.tools.resume_sweep.other_layout`) resumes the same checkpoint:
its state right after loading must equal the uninterrupted run's at the stop step bitwise, and the steps
after it the uninterrupted run's to the layout tolerance (float64 {rtol:g}; bf16 / fp16: finite).
`✓` both passed, `✗` one did not (see the failures), `E` a rank raised. Totals: {totals}. The default
test suite runs the {n_subset} combinations of `ndtrain.tools.resume_sweep.resume_subset()`
(`tests/integration/test_sweep.py`).
"""


def resume_section(results: list[Result], seconds: float, n_all: int, cmd: str = "") -> list[str]:
    by = defaultdict(int)
    for r in results:
        by[f"{r.status} (same layout {r.extra.get('same', '-')}, other {r.extra.get('other', '-')})"] += 1
    n_run = len(results)
    head = RESUME_HEAD.format(cmd=cmd, date=datetime.date.today(), minutes=seconds / 60, n_run=n_run, n_all=n_all,
                              slice_note="" if n_run >= n_all else " (a slice: the rest is not run; `·` below)",
                              steps=RS.RESUME_STEPS, stop=RS.RESUME_STOP, rtol=S.RTOL, n_subset=len(RS.resume_subset()),
                              totals=", ".join(f"{v} {k}" for k, v in sorted(by.items())))
    L = ["", head, "| feature | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for f in S.FEATURES:
        rs = [(r, _uses(r.combo)) for r in results if r.combo.feature == f]
        L.append(f"| {f} | " + " | ".join(_cell([r for r, u in rs if col in u], {}) for col in COLUMNS) + " |")
    L += _failures(results, "### Resume failures", " --resume")
    return L + _per_combo(results, {}, "### Every resumed combination", "####")


def _splice_resume(out: Path, lines: list[str]) -> None:
    """Replace the ``## Resume`` section at the end of ``out`` (or append it)."""
    text = out.read_text() if out.exists() else ""
    text = text.split("\n## Resume: stopped and resumed")[0].rstrip("\n")
    out.write_text(text + "\n" + "\n".join(lines) + "\n")
    print(f"wrote the resume section of {out}")


def _signature(r: Result) -> str:
    """What a failure is, without its numbers: the error, or which compared values were off."""
    if r.status == "mismatch" and "same" in r.extra:  # resume sweep: which part, and its first value
        what = re.findall(r"(?:step \d+ (\w+)|state after loading|final state)", r.detail)
        return f"mismatch: same layout {r.extra['same']}, other layout {r.extra['other']} ({what[0] or 'state'})"
    if r.status == "mismatch":
        return "mismatch: values off: " + r.detail.rsplit(": ", 1)[-1]
    return f"{r.status}: " + re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", r.detail.split(" (rel")[0])[:240]


def _failures(results: list[Result], title: str = "## Known failures", flag: str = "") -> list[str]:
    bad = [r for r in results if r.status in FAIL]
    flaky = [r for r in results if r.status not in FAIL and "first_try" in r.extra]
    L = ["", title, "",
         ("Every failure was run twice, the second time on a fresh process group; a combination that "
          "passed the second time is listed under *Failed once* instead.")]
    if flaky:
        L += ["", "### Failed once, passed on the rerun", ""]
        L += [f"* `{r.combo.key}`: first {r.extra['first_try'].splitlines()[0][:300]}" for r in flaky]
    if not bad:
        return L + ["", "None: every validated combination trained and matched."]
    L.append("\nCombinations that pass validation but then fail, grouped by what failed. Rerun one with "
             f"`python scripts/sweep.py{flag} --only \"<combination>\"`; the `ndtrain train` line is the same "
             "layout on the debug preset (not run by the sweep).")
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in bad:
        groups[_signature(r)].append(r)
    for i, (sig, rs) in enumerate(sorted(groups.items(), key=lambda kv: -len(kv[1])), 1):
        first = rs[0]
        L += ["", f"### F{i}: {len(rs)} combination(s): {sig}", ""]
        notes = {n for pat, n in NOTES.items() for r in rs if re.search(pat, r.combo.key)}
        L += [f"*Note:* {n}" for n in sorted(notes)] + ([""] if notes else [])
        L += [f"* first: `{first.combo.key}`: {first.detail.splitlines()[0][:400]}",
              f"* rerun: `python scripts/sweep.py{flag} --only \"{first.combo.key}\"`",
              f"* as a run: `{first.combo.command()}`",
              "* all: " + "; ".join(f"`{r.combo.key}`" for r in rs)]
    return L


def _per_combo(results: list[Result], ids: dict[str, int], heading: str = "## Every combination",
               sub: str = "###") -> list[str]:
    cell: dict[tuple, str] = {}
    for r in results:
        c = r.combo
        sym = f"R{ids[rule_key(r.detail)]}" if r.status == "rejected" else SYMBOL[r.status]
        lay = c.layout + "".join(f" {k.split('.', 1)[1]}={S._fmt(v)}" for k, v in c.extra)
        cell[(c.tier, c.world, lay, c.ac, c.dtype, c.feature, c.zero)] = sym
    L = ["", heading, "",
         ("One row per layout (and checkpointing policy / dtype); per feature, the outcome for each "
          "ZeRO stage in the order shown (`·`: not in the product).")]
    feats = list(S.FEATURES)
    for tier, title, zeros in (("layout", "float64, no activation checkpointing", S.ZERO_STAGES),
                               ("ac", "float64, by activation-checkpointing policy", (0, 3)),
                               ("dtype", "by dtype", (0, 3)),
                               ("fused", "float64, training.fused_loss", (0, 3)),
                               ("resume", "resume only: DiLoCo, asynchronous saves, float16 loss scale",
                                S.ZERO_STAGES)):
        rows = sorted({k[1:5] for k in cell if k[0] == tier}, key=lambda k: (k[0], k[1], k[2], k[3]))
        if not rows:
            continue
        z = "/".join(f"z{x}" for x in zeros)
        head = "| ranks | layout | AC | dtype | " + " | ".join(f"{f} {z}" for f in feats) + " |"
        L += ["", f"{sub} {title}", "", head, "|---" * (4 + len(feats)) + "|"]
        for w, lay, ac, dt in rows:
            vals = [" ".join(cell.get((tier, w, lay, ac, dt, f, zz), "·") for zz in zeros) for f in feats]
            L.append(f"| {w} | {lay} | {ac} | {dt} | " + " | ".join(vals) + " |")
    return L


def _load(path: Path) -> tuple[list[Result], float]:
    saved, out = json.loads(path.read_text()), []
    for d in saved["results"]:
        c = d.pop("combo")
        out.append(Result(Combo.from_dict(c), **d))
    return out, saved["seconds"]


def _save(results: list[Result], seconds: float, path: Path, n_all: int | None = None, cmd: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"combo": r.combo.to_dict(), "status": r.status, "rel": r.rel, "detail": r.detail,
             "seconds": r.seconds, "extra": r.extra} for r in results]
    path.write_text(json.dumps({"seconds": seconds, "n_all": n_all or len(results), "cmd": cmd, "results": rows},
                               indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    ap.add_argument("--json", type=Path, default=ROOT / "runs" / "sweep" / "results.json")
    ap.add_argument("--resume-json", type=Path, default=ROOT / "runs" / "sweep" / "resume.json")
    ap.add_argument("--only", action="append", default=[], help="exact combination key (repeatable)")
    ap.add_argument("--match", default="", help="run combinations whose key contains this text")
    ap.add_argument("--tiers", default="", help="layout,ac,dtype,fused (default all; --resume: also resume)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one combination may take")
    ap.add_argument("--list", action="store_true", help="validate only; print each combination")
    ap.add_argument("--from-json", type=Path, help="write the doc from saved results")
    ap.add_argument("--resume", action="store_true", help="the resume sweep (ndtrain.tools.resume_sweep)")
    ap.add_argument("--doc", action="store_true", help="with --resume and --match / --only: still write "
                    "the doc's resume section (marked as a slice)")
    a = ap.parse_args()
    if a.from_json and a.resume:  # the resume section again from a saved resume sweep
        results, seconds = _load(a.from_json)
        _splice_resume(a.out, resume_section(results, seconds, json.loads(a.from_json.read_text())["n_all"],
                                             json.loads(a.from_json.read_text()).get("cmd", "")))
        return
    if a.from_json:
        report(*_load(a.from_json), a.out, _resume_saved(a.resume_json))
        return
    tiers = a.tiers.split(",") if a.tiers else [*S.TIERS, "resume"]
    combos = S.enumerate_combos(tuple(t for t in tiers if t in S.TIERS))
    n_all = len(combos)
    if a.resume:  # every combination that trains, and the resume-only ones (tier "resume")
        combos = [c for c in combos if S.check(c) is None] + (RS.resume_extras() if "resume" in tiers else [])
        n_all = sum(S.check(c) is None for c in S.enumerate_combos()) + len(RS.resume_extras())
    sliced = bool(a.only or a.match) or set(tiers) < {*S.TIERS, "resume"}
    if a.only or a.match:
        extra = RS.resume_subset() if a.resume else S.subset_combos()
        combos = [c for c in combos + extra if c.key in a.only or (a.match and a.match in c.key)]
        first: dict[str, Combo] = {}
        for c in combos:  # the product's own combination over the subset's twin of the same key
            first.setdefault(c.key, c)
        combos = list(first.values())
    if a.list:
        for c in combos:
            print(f"{c.key}  ->  {S.check(c) or 'valid'}")
        return
    t0 = time.monotonic()
    results = run(combos, a.timeout, "resume" if a.resume else "layout")
    seconds = time.monotonic() - t0
    if sliced and not (a.resume and a.doc):
        return
    if not a.resume:
        _save(results, seconds, a.json)
        report(results, seconds, a.out, _resume_saved(a.resume_json))
        return
    cmd = ((f" --match \"{a.match}\"" if a.match else "") + "".join(f" --only \"{k}\"" for k in a.only)
           + (f" --tiers {a.tiers}" if a.tiers else ""))
    _save(results, seconds, a.resume_json, n_all, cmd)
    if a.json.exists() and not sliced:
        report(*_load(a.json), a.out, (results, seconds, n_all))
    else:
        _splice_resume(a.out, resume_section(results, seconds, n_all, cmd))


def _resume_saved(path: Path) -> tuple | None:
    """(results, seconds, size of the product) of a saved resume sweep, or None."""
    if not path.exists():
        return None
    results, seconds = _load(path)
    return results, seconds, json.loads(path.read_text()).get("n_all", len(results))


if __name__ == "__main__":
    main()
