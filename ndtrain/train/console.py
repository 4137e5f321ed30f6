"""What a person watching a run sees: a start-up summary, a live progress bar or plain lines, and
``RUN_DIR/console.log``; optionally every metric in TensorBoard.

``RunConsole`` belongs to rank 0 (other ranks get a silent one). Its mode (``progress_mode``):

* ``rich``: a ``rich`` progress display pinned under the scrolling metrics lines: step N/total,
  bar, elapsed and ETA on one line, loss, tokens/s, MFU and memory on the next
  (``ndtrain.train.progress_bar``); chosen by ``logging.progress=auto`` when stdout is a terminal
  and ``CI`` is not set, or forced by ``logging.progress=rich``.
* ``plain``: no bar, no cursor movement or colour, so logs piped to a file or a CI page stay
  readable.

In both modes each metrics line (``metrics.format_line``) of a training step ends with
``| elapsed 0:10 | eta 0:30``.

While the console is open, everything rank 0 writes to stdout / stderr (this module's lines, the
trainer's messages, warnings) is copied to ``RUN_DIR/console.log``, appended across re-runs, so a
run directory keeps what its run said. The progress bar itself is not copied: it is redrawn in
place and would fill the log with frames.

The ETA is the mean step time of this job so far times the steps left, the same in the rows and
the bar.
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from pathlib import Path

from ndtrain.train.metrics import format_line


def progress_mode(setting: str, stream, env: dict | None = None) -> str:
    """``"rich"`` or ``"plain"`` for ``logging.progress`` = ``setting`` (auto | rich | plain):
    auto is rich only on a terminal (``stream.isatty()``) with ``CI`` unset or empty and ``TERM``
    not ``dumb``."""
    env = os.environ if env is None else env
    if setting in ("rich", "plain"):
        return setting
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return "rich" if tty and not env.get("CI") and env.get("TERM") != "dumb" else "plain"


def hms(seconds: float) -> str:
    """``"1:02:03"`` / ``"2:03"`` for a duration in seconds; ``"?"`` when not finite."""
    if not math.isfinite(seconds):
        return "?"
    s = round(max(0.0, seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class _Tee(io.TextIOBase):
    """A text stream writing to ``target`` and appending the same text to ``log``. The copy stops
    at the first write the log refuses (a full disk): the terminal keeps getting every line,
    including the one that says what failed."""

    def __init__(self, target, log):
        self.target, self.log = target, log

    def write(self, s: str) -> int:
        self.target.write(s)
        self._to_log(lambda log: log.write(s))
        return len(s)

    def flush(self) -> None:
        self.target.flush()
        self._to_log(lambda log: log.flush())

    def _to_log(self, op) -> None:
        if self.log is None:
            return
        try:
            op(self.log)
        except OSError:
            self.log = None

    def isatty(self) -> bool:
        return bool(getattr(self.target, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self):
        return getattr(self.target, "encoding", "utf-8")


class RunConsole:
    """Rank 0's console for one job: ``open()`` (log copy), ``begin()`` before the first step (bar),
    ``step`` / ``row`` per step / metrics row, ``close()`` in a ``finally``. Disabled
    (``enabled=False``) every method is a no-op.

    Args:
        run_dir: the run directory (``console.log``, ``tensorboard/`` go there).
        progress: ``logging.progress``; tensorboard: ``logging.tensorboard``.
        stream: where the bar draws (default: ``sys.stdout`` at ``open()``), env: for ``CI``.
    """

    def __init__(self, run_dir: Path, progress: str = "auto", tensorboard: bool = False,
                 enabled: bool = True, stream=None, env: dict | None = None, clock=time.perf_counter):
        self.run_dir, self.total, self.enabled, self._clock = Path(run_dir), 0, enabled, clock
        self._progress_setting, self._tb_on, self._stream, self._env = progress, tensorboard, stream, env
        self.mode = "off"
        self._log = self._tb = self._bar = self._task = None
        self._saved: tuple | None = None
        self._t0, self._first = clock(), None
        self._fields = {"loss": "-", "tps": "-", "mfu": "-", "mem": "-"}

    def open(self) -> RunConsole:
        """Choose the mode, start copying stdout / stderr to ``console.log``, open TensorBoard."""
        if not self.enabled:
            return self
        self._stream = self._stream or sys.stdout
        self.mode = progress_mode(self._progress_setting, self._stream, self._env)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir / "console.log", "a", buffering=1)  # noqa: SIM115 (closed by close())
        self._log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S %Z')} ---\n")
        self._tee()
        if self._tb_on:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        return self

    def _tee(self) -> None:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._log), _Tee(sys.stderr, self._log)

    def _untee(self) -> None:
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None

    def begin(self, first_step: int, total_steps: int) -> None:
        """Before the first step of this job: ``first_step`` (not 1 after a resume) up to
        ``total_steps`` (``training.steps`` or ``stop_at_step``); starts the clock and the bar."""
        if not self.enabled:
            return
        self._first, self.total, self._t0 = first_step, total_steps, self._clock()
        if self.mode == "rich" and self._bar is None:
            # the bar redirects stdout / stderr itself; the copy to console.log is re-applied on top
            self._untee()
            self._start_bar(self._stream, first_step)
            self._tee()

    def _start_bar(self, stream, first_step: int) -> None:
        from rich.console import Console

        from ndtrain.train.progress_bar import RunProgress

        # redirect_stdout: prints during the run scroll above the bar instead of tearing it.
        # 2 redraws / s, not rich's 10: each costs ~1 ms of CPU under the GIL beside the step's own
        # dispatch (measured: 0.9 ms), and the bar changes once a step; the clock still ticks.
        self._bar = RunProgress(self.times, self.fields_line, console=Console(file=stream),
                                redirect_stdout=True, redirect_stderr=True, transient=False,
                                refresh_per_second=2)
        self._bar.start()
        self._task = self._bar.add_task("train", total=self.total, completed=first_step - 1)

    def times(self, step: int) -> str:
        """``"elapsed 0:10 | eta 0:30"`` after ``step``, by this console's clock."""
        elapsed = self._clock() - self._t0
        return f"elapsed {hms(elapsed)} | eta {hms(self.eta_s(step, elapsed))}"

    def fields_line(self) -> str:
        """The bar's metrics line: ``"loss 5.1250 | 1,234 tok/s | MFU 1.5% | mem 300 MiB"``."""
        f = self._fields
        return f"loss {f['loss']} | {f['tps']} tok/s | MFU {f['mfu']} | mem {f['mem']}"

    def step(self, step: int, out: dict) -> None:
        """After optimizer step ``step`` (``out``: the trainer's step dict with ``loss``)."""
        if self._bar is not None:
            self._fields["loss"] = f"{out['loss']:.4f}"
            self._bar.update(self._task, completed=step)

    def eta_s(self, step: int, elapsed_s: float) -> float:
        """Seconds left after ``step``: this job's mean seconds per step so far times the steps left."""
        done = step - (self._first or 1) + 1
        return elapsed_s / done * (self.total - step) if done > 0 else math.nan

    def row(self, row: dict) -> None:
        """Echo a metrics row: a line (a training row ends with elapsed / ETA), bar fields, TensorBoard."""
        if not self.enabled:
            return
        line = format_line(row)
        if "loss" in row:
            line += f" | {self.times(row['step'])}"
        print(line, flush=True)
        if "tokens_per_s" in row:
            self._fields["tps"] = f"{row['tokens_per_s']:,.0f}"
        if row.get("mfu") is not None:
            self._fields["mfu"] = f"{100 * row['mfu']:.1f}%"
        if "peak_mem_bytes" in row:
            self._fields["mem"] = f"{row['peak_mem_bytes'] / 2**20:,.0f} MiB"
        if self._bar is not None:
            self._bar.refresh()
        if self._tb is not None:
            write_tensorboard(self._tb, row)

    def close(self) -> None:
        """Stop the bar, restore stdout / stderr, close the log and TensorBoard (idempotent)."""
        self._untee()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._log is not None:
            log, self._log = self._log, None
            try:
                log.close()
            except OSError:  # a full disk: what it refused is lost, the run's error is elsewhere
                pass


def tensorboard_scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics row as TensorBoard scalars: nested dicts (``comm_bytes``) become
    ``comm_bytes/<axis>``; ``step`` and ``time`` (the x axes), None, bools and strings are left out."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(tensorboard_scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "time"):
            out[name] = float(value)
    return out


def write_tensorboard(writer, row: dict) -> None:
    for name, value in tensorboard_scalars(row).items():
        writer.add_scalar(name, value, global_step=row["step"], walltime=row.get("time"))
    writer.flush()


def param_count(model_cfg) -> int:
    """Parameters of the whole model (tied weights once), counted on the meta device: no memory,
    and the same number whatever share of it a sharded rank holds."""
    import torch

    from ndtrain.model import Transformer, count_params

    with torch.device("meta"):
        return count_params(Transformer(model_cfg))


def _data_facts(run_dir: Path, data, cfg) -> dict:
    """Corpus facts: ``RUN_DIR/data_summary.json`` when the run wrote one, else from the token
    folder's meta and the source files (``truncated`` then compares their bytes with the cap)."""
    path = Path(run_dir) / "data_summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    meta, d = data.meta, cfg.data
    facts = {"source": d.source, "tokenizer": d.tokenizer, "train_tokens": data.num_tokens("train"),
             "val_tokens": data.num_tokens("val"), "truncated": None}
    if d.max_corpus_bytes > 0:
        try:
            from ndtrain.data.corpus import resolve_files

            facts["truncated"] = sum(p.stat().st_size for p in resolve_files(d)) > d.max_corpus_bytes
        except (OSError, ValueError):
            pass
    facts.setdefault("vocab_size", meta.get("tokenizer_vocab_size"))
    return facts


def startup_summary(cfg, dims, data, run_dir: Path, n_params: int, fpt: float, peak: float | None,
                    device: str, basis: str = "") -> list[str]:
    """The lines printed before the first step: parameters, layout per mesh axis, corpus tokens,
    epochs the run covers, whether ``data.max_corpus_bytes`` cut the corpus, FLOPs and peak (and
    its ``basis``, ``ndtrain.train.peak.peak_basis``, when given)."""
    from ndtrain import __version__

    t, T = cfg.training, cfg.data.seq_len
    facts = _data_facts(run_dir, data, cfg)
    n_seq = max(1, data.num_sequences("train", T))
    epochs = t.steps * t.global_batch_size / n_seq
    degrees = dict(dims.degrees(), ep=dims.ep)  # ep borrows its ranks from dp_shard x cp
    axes = ", ".join(f"{a} {n}" for a, n in degrees.items())
    cap = cfg.data.max_corpus_bytes
    trunc = ("no cap (data.max_corpus_bytes=0)" if cap <= 0 else
             f"truncated at data.max_corpus_bytes={cap:,}" if facts.get("truncated") else
             f"whole corpus (under data.max_corpus_bytes={cap:,})" if facts.get("truncated") is False
             else f"data.max_corpus_bytes={cap:,}")
    peak_s = f"{peak / 1e9:,.1f} GFLOP/s per rank" if peak else "unknown peak (MFU not reported)"
    peak_s += f" ({basis})" if peak and basis else ""
    loud = []  # forced-balanced MoE routing (benchmarks) must not pass for a real run's figures
    if cfg.model.is_moe and t.moe_routing == "balanced":
        loud.append("moe_routing: balanced -- FORCED round-robin expert routing for benchmarking; "
                    "losses and MoE figures are not those of learned routing")
    return loud + [
        f"ndtrain {__version__} | run dir {run_dir} | {n_params / 1e6:.2f}M parameters | {t.dtype} on {device}",
        f"layout {dims}: {axes}",
        (f"data: {facts.get('source')} | {facts.get('train_tokens', 0):,} train + "
         f"{facts.get('val_tokens', 0):,} val tokens | tokenizer {facts.get('tokenizer')} | {trunc}"),
        (f"plan: {t.steps} steps x {t.global_batch_size} seq x {T} tokens = "
         f"{t.steps * t.global_batch_size * T:,} tokens = {epochs:.2f} epochs of the train split"),
        f"compute: {fpt / 1e6:,.1f} MFLOP/token | {peak_s}",
        *_feature_lines(cfg),
        *_pipeline_lines(cfg),
        *_thread_lines(),
    ]


def _pipeline_lines(cfg) -> list[str]:
    """Under pp > 1, the schedule and the blocks each pp rank holds (its virtual stages in order,
    ``E`` / ``L`` where the embedding / head sit), as ``parallel/pp/stage.plan_stage`` splits them."""
    p = cfg.parallel
    if p.pp <= 1:
        return []
    from ndtrain.parallel.pp.stage import plan_stage

    def runs(ids: list[str]) -> str:
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else (ids[0] if ids else "-")

    ranks, shown = [], range(p.pp) if p.pp <= 6 else [0, 1, 2, p.pp - 2, p.pp - 1]  # long layouts: the ends
    for r in shown:
        if r == p.pp - 2 and p.pp > 6:
            ranks.append("...")
        info = plan_stage(cfg, r)
        parts = [runs(c) for c in info.chunks]
        ranks.append(f"{r}: " + ("E " if info.first else "") + ",".join(parts) + (" L" if info.last else ""))
    m = f"{p.pp_microbatches} microbatches" if p.pp_microbatches else "microbatches of training.micro_batch_size"
    v = f" x v {p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else ""
    return [f"pipeline: {p.pp_schedule}, pp {p.pp}{v}, {m} | blocks per rank: " + " | ".join(ranks)]


def _feature_lines(cfg) -> list[str]:
    """One line naming the optimizer and the training features that are on (none for a plain AdamW
    run), so a run shows that a key it was given took effect."""
    t, f = cfg.training, cfg.finetune
    on = []
    if t.optimizer == "muon":
        on.append(f"Muon (lr {t.muon_lr or t.lr:g}, {t.muon_scale} scale, {t.muon_ns_steps} NS steps)"
                  + (f" + QK-clip tau {t.qk_clip:g}" if t.qk_clip else ""))
    if t.mup_base_width:
        on.append(f"width transfer from model.dim {t.mup_base_width} (hidden LRs and init std)")
    if f.lora_rank:
        on.append(f"LoRA rank {f.lora_rank} alpha {f.lora_alpha:g} on {f.lora_targets} (base frozen)")
    if cfg.data.document_mask:
        on.append("packed documents masked (data.document_mask)")
    return [f"training: {'; '.join(on)}"] if on else []


def _thread_lines() -> list[str]:
    """The launch's thread policy (``ndtrain.spawn.thread_policy``) and its warning, if any."""
    import torch

    from ndtrain.spawn import current_policy

    policy = current_policy()
    return [policy.describe(torch.get_num_threads()), *filter(None, [policy.warning()])]
