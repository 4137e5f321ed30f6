"""The ``rich`` progress display of a run (``logging.progress=rich``): two lines pinned under the
scrolling metrics rows.

    step 4/20 ━━━━━━━━━╺━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ elapsed 0:10 | eta 0:40
    loss 5.1250 | 1,234 tok/s | MFU 1.5% | mem 300 MiB

The first line is the step count, the bar and the times; the bar takes whatever width is left, so
at 80 columns (and down to about 40) the ETA is never cut. The metrics get a line of their own
instead of competing with the times for one. Elapsed and ETA are the console's own numbers (the
same as the rows' ``| elapsed | eta``), computed when a frame is drawn, so they tick between steps.
Imported only when the bar is used (``ndtrain.train.console``).
"""
from __future__ import annotations

from collections.abc import Callable

from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.table import Column
from rich.text import Text


class TimesColumn(ProgressColumn):
    """``times(completed_steps)`` as text: ``"elapsed 0:10 | eta 0:40"``."""

    def __init__(self, times: Callable[[int], str]):
        super().__init__(table_column=Column(no_wrap=True, overflow="fold"))
        self._times = times

    def render(self, task) -> Text:
        return Text(self._times(int(task.completed)), no_wrap=True)


class RunProgress(Progress):
    """One task's bar (``step N/total``, bar, ``times``) and under it ``fields_line()``; the rest
    of the arguments are ``rich.progress.Progress``'s (console, redirect_stdout, ...)."""

    def __init__(self, times: Callable[[int], str], fields_line: Callable[[], str], **kwargs):
        self._fields_line = fields_line  # first: Progress draws a frame while it is built
        super().__init__(TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=None, table_column=Column(ratio=1)),
                         TimesColumn(times), expand=True, **kwargs)

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        yield Text(self._fields_line(), no_wrap=True, overflow="ellipsis")
