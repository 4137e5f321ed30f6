"""Which blocks each virtual stage holds: ``parallel.pp_layout`` parsed and checked, or the blocks
balanced by their costs when it is empty (docs/pipeline_parallel.md, "Stage layouts").

The layout syntax is Megatron-LM's ``--pipeline-model-parallel-layout``: virtual stages in forward
order separated by ``|``; ``E`` the token embedding, ``t`` a transformer block, ``m`` an MTP depth,
``L`` the final norm, output head and loss; ``X*N`` / ``(...)*N`` repeat; commas and spaces are
cosmetic. ``"E|(t|)*126,L"`` is Llama 3 405B on pp16 x v8. Here ``E`` must open stage 0 and ``L``
close the last stage, MTP depths sit with ``L`` (their stage needs the last hidden state and the
head; a layout without ``m`` puts them there too), and no stage may be empty. Pure Python; raises ``ConfigError`` naming the rule."""
from __future__ import annotations

from ndtrain.errors import ConfigError, require

SYMBOLS = "EtmL"  # embedding, transformer block, MTP depth, loss (norm + head)


def expand(text: str) -> str:
    """``text`` with repetitions unrolled and cosmetic characters dropped: a string over ``EtmL|``.
    ``"E(t|)*2L"`` -> ``"Et|t|L"``. Raises ConfigError on an unknown character, a ``*`` without a
    count >= 1 or a group to repeat, or unbalanced parentheses."""
    return _sequence(text, 0, top=True)[0]


def _sequence(text: str, i: int, top: bool) -> tuple[str, int]:
    """Parse items from ``i`` until ``)`` (inside a group) or the end; returns (expansion, index)."""
    out: list[str] = []
    while i < len(text):
        ch = text[i]
        if ch in " ,\t":
            i += 1
        elif ch in SYMBOLS or ch == "|":
            out.append(ch)
            i += 1
        elif ch == "(":
            inner, i = _sequence(text, i + 1, top=False)
            out.append(inner)
        elif ch == ")":
            require(not top, f"parallel.pp_layout ({text!r}): ')' at position {i} closes no '('")
            return "".join(out), i + 1
        elif ch == "*":
            require(bool(out), f"parallel.pp_layout ({text!r}): '*' at position {i} repeats nothing")
            j = i + 1
            while j < len(text) and text[j].isdigit():
                j += 1
            require(j > i + 1 and int(text[i + 1:j]) >= 1,
                    f"parallel.pp_layout ({text!r}): '*' at position {i} needs a count >= 1 after it")
            out[-1] = out[-1] * int(text[i + 1:j])
            i = j
        else:
            raise ConfigError(f"parallel.pp_layout ({text!r}): unknown token {ch!r} at position {i} "
                              "(E embedding, t block, m MTP depth, L head + loss, | stage boundary, "
                              "X*N or (...)*N repetition)")
    require(top, f"parallel.pp_layout ({text!r}): a '(' is never closed")
    return "".join(out), i


def parse_layout(text: str) -> list[str]:
    """The virtual stages of ``text`` in forward order, each as its symbols: ``"Et*2|t,L"`` ->
    ``["Ett", "tL"]``."""
    return expand(text).split("|")


def check_layout(text: str, n_stages: int, n_layers: int, mtp_depth: int = 0) -> list[str]:
    """Parse ``text`` and check it against the model and the schedule's ``n_stages`` virtual stages
    (pp * pp_virtual_stages; 2 pp under DualPipeV). Returns the stages (``parse_layout``). Raises
    ConfigError naming the first rule that fails."""
    stages = parse_layout(text)
    head = f"parallel.pp_layout ({text!r})"
    require(len(stages) == n_stages, f"{head} has {len(stages)} stages ('|'-separated); the schedule runs "
                                     f"{n_stages} virtual stages (pp * pp_virtual_stages, 2 * pp under dualpipev)")
    empty = [s for s, syms in enumerate(stages) if not syms]
    require(not empty, f"{head}: virtual stage {empty[0] if empty else 0} holds nothing (each stage needs a "
                       "block, the embedding or the head)")
    joined = "".join(stages)
    n_t, n_m = joined.count("t"), joined.count("m")
    require(n_t == n_layers, f"{head} places {n_t} transformer blocks ('t'); model.n_layers is {n_layers}")
    require(n_m in (0, mtp_depth), f"{head} places {n_m} MTP depths ('m'); model.mtp_depth is {mtp_depth} "
                                   "(write all of them on the last stage, or none: they then sit with 'L')")
    require(joined.count("E") == 1 and stages[0].startswith("E"),
            f"{head}: the embedding 'E' must appear once, first in virtual stage 0")
    require(joined.count("L") == 1 and stages[-1].endswith("L"),
            f"{head}: the head and loss 'L' must appear once, last in the last virtual stage")
    last = stages[-1]
    require(all("m" not in s for s in stages[:-1]),
            f"{head}: MTP depths 'm' must sit on the last virtual stage, with the head they feed")
    require("t" not in last[min((last.find(c) for c in "mL" if c in last), default=len(last)):],
            f"{head}: a block 't' after 'm' / 'L' in the last stage (blocks run before MTP and the head)")
    return stages


def layout_runs(text: str, n_stages: int, n_layers: int, mtp_depth: int = 0) -> list[list[int]]:
    """Block ids of each virtual stage under layout ``text`` (checked by ``check_layout``):
    ``"E|t*3|t|t,L"`` over 5 blocks -> ``[[], [0, 1, 2], [3], [4]]``."""
    runs, nxt = [], 0
    for syms in check_layout(text, n_stages, n_layers, mtp_depth):
        k = syms.count("t")
        runs.append(list(range(nxt, nxt + k)))
        nxt += k
    return runs


def balanced_runs(blocks: list[float], n_stages: int, first_extra: float = 0.0,
                  last_extra: float = 0.0) -> list[list[int]]:
    """Block ids of each virtual stage, balanced by per-block costs ``blocks`` (stage 0 adds
    ``first_extra``, the embedding; the last ``last_extra``, the head): with at least one block per
    stage, ``split_layers`` unchanged; with one or two blocks fewer than stages, the first
    stage holds only the embedding and (two fewer) the last only the head, the rest split evenly by
    cost (Llama 3, 2024, section 3.3.2; the planner's ``split_stages`` does the same). Raises
    ConfigError with more than two stages beyond the blocks."""
    n = len(blocks)
    if n >= n_stages:
        return split_layers(blocks, n_stages, first_extra, last_extra)
    spare = n_stages - n
    require(spare <= 2, f"n_layers ({n}) < pp * pp_virtual_stages ({n_stages}) - 2: every pipeline stage but "
                        "the first and the last (which may hold only the embedding / the head) needs a block")
    return [[]] + split_layers(blocks, n_stages - spare) + [[]] * (spare - 1)


def split_layers(blocks: list[float], n_stages: int, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> list[list[int]]:
    """Cut ``blocks`` (per-block costs) into ``n_stages`` contiguous non-empty runs (stage 0 adds
    ``first_extra``, the last ``last_extra``): minimal largest cost, then sum of squares. Used by the
    trainer and the planner. Raises ValueError if len(blocks) < n_stages."""
    n = len(blocks)
    if n < n_stages:
        raise ValueError(f"n_layers ({n}) < pipeline stages pp * v ({n_stages})")
    pre = [0.0]
    for c in blocks:
        pre.append(pre[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        return (pre[j] - pre[i] + (first_extra if s == 0 else 0.0)
                + (last_extra if s == n_stages - 1 else 0.0))

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]  # best[s][j]: first j blocks in s stages
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                c = cost(s - 1, i, j)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    runs, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        runs.append(list(range(i, j)))
        j = i
    return runs[::-1]


def format_layout(runs: list[list[int]], mtp_depth: int = 0) -> str:
    """``runs`` written in the layout syntax, equal neighbouring stages folded: ``[[], [0], [1], []]``
    -> ``"E|(t|)*2,L"``. ``layout_runs`` of the result gives ``runs`` back."""
    stages = ["t" * len(r) for r in runs]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_depth + "L"
    if len(stages) == 1:
        return _fold(stages[0])
    mid, parts = stages[1:-1], [_fold(stages[0])]
    i = 0
    while i < len(mid):
        j = i
        while j < len(mid) and mid[j] == mid[i]:
            j += 1
        parts.append(_fold(mid[i]) if j - i == 1 else f"({_fold(mid[i])}|)*{j - i},")
        i = j
    return _join(parts) + _fold(stages[-1])


def _join(parts: list[str]) -> str:
    """Join stage texts with '|'; a folded group ``(...|)*N,`` carries its own trailing boundary."""
    out = ""
    for p in parts:
        out += p if p.endswith(",") else p + "|"
    return out


def _fold(stage: str) -> str:
    """``"Ettt"`` -> ``"Et*3"``: runs of one symbol longer than 2 written with ``*``."""
    out, i = "", 0
    while i < len(stage):
        j = i
        while j < len(stage) and stage[j] == stage[i]:
            j += 1
        out += stage[i] * (j - i) if j - i <= 2 else f"{stage[i]}*{j - i}"
        i = j
    return out
