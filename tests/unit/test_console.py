"""The run console (``ndtrain.train.console``) and the metrics log's console-facing parts.

Single process, no training: the console is driven with hand-made metric rows, so each check
states the exact line, log content or TensorBoard scalar a given row must produce.
"""
from __future__ import annotations

import io
import json
import sys
import time

import pytest

from ndtrain.config import load_config
from ndtrain.mesh import ParallelDims
from ndtrain.train import console, metrics


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


ROWS = [{"step": 0, "val_loss": 6.5},
        {"step": 2, "loss": 6.25, "lr": 3e-3, "grad_norm": 2.0, "tokens_per_s": 1234.0, "mfu": 0.015,
         "peak_mem_bytes": 300 * 2**20, "comm_bytes": {"dp": 4096, "tp": 512}},
        {"step": 4, "loss": 5.5, "lr": 1.5e-3, "grad_norm": 1.5, "tokens_per_s": 2000.0, "mfu": None,
         "peak_mem_bytes": 310 * 2**20, "comm_bytes": {"dp": 8192}, "val_loss": 5.25}]


def test_progress_mode_auto_rich_only_on_a_terminal_outside_ci():
    assert console.progress_mode("auto", _TTY(), {}) == "rich"
    assert console.progress_mode("auto", io.StringIO(), {}) == "plain"  # piped / redirected
    assert console.progress_mode("auto", _TTY(), {"CI": "true"}) == "plain"
    assert console.progress_mode("auto", _TTY(), {"TERM": "dumb"}) == "plain"
    assert console.progress_mode("auto", _TTY(), {"CI": ""}) == "rich"  # an empty CI is unset
    assert console.progress_mode("plain", _TTY(), {}) == "plain"
    assert console.progress_mode("rich", io.StringIO(), {"CI": "1"}) == "rich"


def test_hms():
    assert console.hms(0) == "0:00"
    assert console.hms(125.4) == "2:05"
    assert console.hms(3 * 3600 + 62) == "3:01:02"
    assert console.hms(float("nan")) == "?"


def test_plain_mode_lines_console_log_and_restored_streams(tmp_path, monkeypatch):
    """Plain mode prints ``format_line`` plus elapsed / ETA, copies stdout and stderr to
    console.log, and puts ``sys.stdout`` / ``sys.stderr`` back on close."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    ticks = iter([0.0, 100.0, 110.0, 120.0])  # construction, begin, row of step 2, row of step 4
    con = console.RunConsole(tmp_path, progress="auto", env={}, clock=lambda: next(ticks)).open()
    assert con.mode == "plain"  # a StringIO is not a terminal
    print("resumed from somewhere")
    con.begin(first_step=1, total_steps=8)
    for row in ROWS:
        con.row(row)
    print("a warning", file=sys.stderr)
    con.close()
    assert sys.stdout is out and sys.stderr is err
    lines = out.getvalue().splitlines()
    assert lines[0] == "resumed from somewhere"
    assert lines[1] == "step     0 | val 6.5000"  # no elapsed / ETA on a validation-only row
    # step 2 after 10 s: 5 s / step, 6 steps left -> 30 s
    assert lines[2] == (metrics.format_line(ROWS[1]) + " | elapsed 0:10 | eta 0:30")
    assert "mfu 1.5%" in lines[2] and "mem 300 MiB" in lines[2]
    # step 4 after 20 s: 5 s / step, 4 steps left -> 20 s
    assert lines[3].endswith("| elapsed 0:20 | eta 0:20") and "mfu unknown peak" in lines[3]
    assert err.getvalue() == "a warning\n"
    log = (tmp_path / "console.log").read_text().splitlines()
    assert log[0].startswith("--- ")  # one stamp per job: the log is appended across re-runs
    assert log[1:] == lines + ["a warning"]


def test_rich_mode_bar_fields_and_log_without_frames(tmp_path, monkeypatch):
    """Rich mode (forced; a StringIO stands in for the terminal): metric lines scroll in the
    stream and go to console.log; the bar's last frame shows step, loss, tok/s, MFU and memory;
    the bar itself is kept out of console.log."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    con = console.RunConsole(tmp_path, progress="rich", stream=out, env={}).open()
    assert con.mode == "rich"
    con.begin(first_step=1, total_steps=4)
    con.row(ROWS[1])
    con.step(4, {"loss": 5.125})
    con.close()
    assert sys.stdout is out
    text = out.getvalue()
    assert metrics.format_line(ROWS[1]) in text
    assert "step 4/4" in text and "loss 5.1250" in text
    assert "1,234 tok/s" in text and "MFU 1.5%" in text and "mem 300 MiB" in text
    log = (tmp_path / "console.log").read_text()
    assert metrics.format_line(ROWS[1]) in log and "step 4/4" not in log


def _draw(con: console.RunConsole, width: int, completed: int) -> list[str]:
    """The rich progress display of ``con`` at ``completed`` steps, drawn on a recording terminal
    of ``width`` columns, as plain text lines."""
    from rich.console import Console, Group

    from ndtrain.train.progress_bar import RunProgress

    term = Console(width=width, force_terminal=True, record=True, file=io.StringIO())
    bar = RunProgress(con.times, con.fields_line, console=term, auto_refresh=False)
    bar.update(bar.add_task("train", total=con.total, completed=0), completed=completed)
    term.print(Group(*bar.get_renderables()))
    return term.export_text().splitlines()


@pytest.mark.parametrize("total, done, t_end, times", [
    (20, 4, 10.0, "elapsed 0:10 | eta 0:40"),  # 2.5 s / step, 16 steps left
    (200000, 123456, 36000.0, "elapsed 10:00:00 | eta 6:12:00"),  # 76,544 steps left at 0.2916 s / step
])
def test_rich_bar_at_80_columns_keeps_the_eta(tmp_path, total, done, t_end, times):
    """At 80 columns the first line ends with the full elapsed / ETA (the bar gives way), the
    metrics have their own line; before, one line cut the ETA off at 80 columns."""
    clock = iter([0.0, 0.0, t_end, t_end])  # construction, begin, each frame's times
    con = console.RunConsole(tmp_path, progress="plain", env={}, clock=lambda: next(clock))
    con.begin(first_step=1, total_steps=total)
    con.row(ROWS[1])  # fills tok/s, MFU and memory (its own line went to stdout; clock tick 3)
    con.step(done, {"loss": 5.125})
    con.close()
    first, second = _draw(con, 80, done)
    assert len(first) == 80 and first.startswith(f"step {done}/{total} ━") and first.endswith(" " + times)
    assert second == "loss - | 1,234 tok/s | MFU 1.5% | mem 300 MiB"  # loss: set by step() on a bar only


def test_rich_rows_carry_elapsed_and_eta_like_plain_rows(tmp_path, monkeypatch):
    """A metrics line printed under the bar ends with ``| elapsed | eta`` exactly as a piped one."""
    lines = {}
    for mode in ("plain", "rich"):
        out = io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        ticks = iter([0.0, 100.0] + [110.0] * 50)  # rich also asks the clock for each frame
        con = console.RunConsole(tmp_path / mode, progress=mode, stream=out, env={},
                                 clock=lambda t=ticks: next(t)).open()
        con.begin(first_step=1, total_steps=8)
        con.row(ROWS[1])
        con.close()
        lines[mode] = [ln for ln in out.getvalue().splitlines() if ln.startswith("step     2")]
    want = metrics.format_line(ROWS[1]) + " | elapsed 0:10 | eta 0:30"
    assert lines["plain"] == [want] and lines["rich"] == [want]


def test_disabled_console_touches_nothing(tmp_path):
    before = sys.stdout
    con = console.RunConsole(tmp_path / "r", enabled=False).open()
    con.begin(1, 2)
    con.row(ROWS[1])
    con.close()
    assert sys.stdout is before and not (tmp_path / "r").exists()


def test_tensorboard_scalars_flatten_and_skip():
    s = console.tensorboard_scalars({**ROWS[2], "time": 1.0, "skipped": True, "note": "x"})
    assert s == {"loss": 5.5, "lr": 1.5e-3, "grad_norm": 1.5, "tokens_per_s": 2000.0,
                 "peak_mem_bytes": float(310 * 2**20), "comm_bytes/dp": 8192.0, "val_loss": 5.25}


def test_tensorboard_written_and_read_back(tmp_path):
    pytest.importorskip("tensorboard")  # an optional extra; its absence is a config error (below)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    con = console.RunConsole(tmp_path, progress="plain", tensorboard=True, stream=io.StringIO(), env={})
    con.open()
    con.begin(1, 4)
    for row in ROWS:
        con.row(dict(row, time=1000.0 + row["step"]))
    con.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [(e.step, e.value, e.wall_time) for e in loss] == [(2, 6.25, 1002.0), (4, 5.5, 1004.0)]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [(0, 6.5), (4, 5.25)]
    assert [(e.step, e.value) for e in acc.Scalars("comm_bytes/tp")] == [(2, 512.0)]
    assert "mfu" in acc.Tags()["scalars"]  # logged where known (step 2), skipped where None


def test_tensorboard_without_package_is_a_config_error(monkeypatch):
    import importlib.util

    from ndtrain.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="logging.tensorboard=true needs the tensorboard package"):
        load_config("debug", {"logging.tensorboard": "true"})
    with pytest.raises(ConfigError, match=r"logging.progress \(fancy\) must be auto\|rich\|plain"):
        load_config("debug", {"logging.progress": "fancy"})


def test_metrics_rows_carry_unix_time(tmp_path, capsys):
    log = metrics.MetricsLog(tmp_path, enabled=True)
    t0 = time.time()
    log.log({"step": 1, "loss": 2.0})
    t1 = time.time()
    row = metrics.read_metrics(tmp_path)[0]
    assert t0 - 0.01 <= row["time"] <= t1 + 0.01
    assert capsys.readouterr().out == "step     1 | loss 2.0000\n"  # default echo: format_line


def test_loss_figure_title_and_lr_panel():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = metrics.loss_figure(ROWS, "my-run")
    try:
        assert fig._suptitle.get_text() == "my-run"
        (lr_ax,) = [ax for ax in fig.axes if ax.get_ylabel() == "learning rate"]
        (line,) = lr_ax.get_lines()
        assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [3e-3, 1.5e-3]
    finally:
        plt.close(fig)


class _FakeData:
    def __init__(self):
        self.meta = {"tokenizer_vocab_size": 257}

    def num_tokens(self, split):
        return {"train": 10_000, "val": 200}[split]

    def num_sequences(self, split, T):
        return (self.num_tokens(split) - 1) // T


def test_startup_summary_numbers(tmp_path):
    cfg = load_config("debug", {"training.steps": "39", "data.max_corpus_bytes": "5000"})
    dims = ParallelDims.from_config(load_config("debug", {"parallel.tp": "2"}, world_size=4).parallel, 4)
    (tmp_path / "data_summary.json").write_text(json.dumps(
        {"source": "corpus.txt", "tokenizer": "bytes", "train_tokens": 10_000, "val_tokens": 200,
         "truncated": True}))
    lines = console.startup_summary(cfg, dims, _FakeData(), tmp_path, 1_500_000, 7.0e5, 2e9, "cpu")
    assert "1.50M parameters" in lines[0] and "float32 on cpu" in lines[0]
    assert lines[1] == "layout dp_shard2 x tp2 (world 4): pp 1, dp_replicate 1, dp_shard 2, cp 1, tp 2, ep 1"
    assert "10,000 train + 200 val tokens" in lines[2] and "truncated at data.max_corpus_bytes=5,000" in lines[2]
    # 39 steps x 8 sequences over (10000 - 1) // 32 = 312 train sequences = 1.00 epoch
    assert lines[3] == "plan: 39 steps x 8 seq x 32 tokens = 9,984 tokens = 1.00 epochs of the train split"
    assert lines[4] == "compute: 0.7 MFLOP/token | 2.0 GFLOP/s per rank"


def test_param_count_is_the_whole_model():
    from ndtrain.model import build_model

    cfg = load_config("debug").model
    assert console.param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_feature_line_names_what_is_on_and_nothing_for_a_plain_run():
    from ndtrain.config import load_config
    from ndtrain.train.console import _feature_lines

    cfg = load_config("debug")
    assert _feature_lines(cfg) == []
    t = cfg.training
    t.optimizer, t.qk_clip, t.mup_base_width, t.lr = "muon", 50.0, 32, 1e-3
    cfg.finetune.lora_rank, cfg.data.document_mask = 4, True
    assert _feature_lines(cfg) == [
        "training: Muon (lr 0.001, moonlight scale, 5 NS steps) + QK-clip tau 50; width transfer from "
        "model.dim 32 (hidden LRs and init std); LoRA rank 4 alpha 16 on *.wq,*.wk,*.wv,*.wo (base frozen); "
        "packed documents masked (data.document_mask)"]


def test_pipeline_line_names_the_schedule_and_each_ranks_blocks():
    """pp > 1: the start-up summary says which blocks each pp rank holds (E / L: embedding / head);
    pp 1 prints nothing; long pipelines show their two ends."""
    from ndtrain.train.console import _pipeline_lines

    assert _pipeline_lines(load_config("debug")) == []
    cfg = load_config("debug", {"parallel.pp": "2", "parallel.pp_microbatches": "4", "model.n_layers": "4",
                                "parallel.pp_layout": "Et|ttt,L"}, world_size=2)
    assert _pipeline_lines(cfg) == ["pipeline: 1f1b, pp 2, 4 microbatches | blocks per rank: 0: E 0 | 1: 1-3 L"]
    big = load_config("llama3_405b", {"parallel.pp": "16", "parallel.tp": "8", "parallel.dp_shard": "64",
                                      "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": "8",
                                      "parallel.pp_layout": "E|(t|)*126,L"}, world_size=8192)
    (line,) = _pipeline_lines(big)
    assert "pp 16 x v 8" in line and "0: E -,15,31,47,63,79,95,111 |" in line and " | ... | 14: " in line
    assert line.endswith("15: 14,30,46,62,78,94,110,- L")
