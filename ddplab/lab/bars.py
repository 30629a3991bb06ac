"""The kernel's half of live training progress: one bar per rank while a ddplab cell runs.

On the ranks, a training loop calls ``ddplab.progress.report(step, total,
loss=...)``, which publishes through ipyparallel's data channel. While the lab
waits for the ranks (``ddplab.lab.calls``), it hands each rank's latest
numbers to a ``ProgressBars``. The bars appear when the first rank reports: in
Jupyter one ``ipywidgets`` bar per rank, updated live; elsewhere a text line
per rank at every quarter of the way.

The bars' text form (what nbval compares, and what a viewer without widgets
shows) is one fixed line naming the ranks, so a stored notebook is identical
from run to run even though the bars moved at different speeds.
"""

from __future__ import annotations

import logging
from typing import Any

from ..progress import KEY
from .channel import published

#: How long the kernel waits, once per finished rank, for its last update to arrive.
FLUSH_TIMEOUT = 2.0
log = logging.getLogger(__name__)


def record_text(record: dict) -> str:
    """``12/46  epoch=2 loss=0.5312``: a rank's progress as one line of text."""
    metrics = " ".join(f"{name}={_number(value)}" for name, value in record["metrics"].items())
    return f"{record['step']}/{record['total']}" + (f"  {metrics}" if metrics else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def headline(ranks: list[int]) -> str:
    """The bars' fixed text form."""
    return f"Live progress, one bar per rank ({', '.join(f'rank {r}' for r in ranks)})"


class ProgressBars:
    """The kernel's view of every rank's progress during one wait of the lab.

    ``update({rank: async_result})`` reads each rank's ipyparallel
    AsyncResult ``.data``; nothing is shown until some rank has reported. A
    failure to draw is swallowed: a progress bar must never be the reason a
    training run fails.
    """

    def __init__(self) -> None:
        self._view: _WidgetView | _TextView | None = None
        self._flushed: set[int] = set()
        self._broken = False

    def update(self, results: dict[int, Any]) -> None:
        if self._broken:
            return
        try:
            if self._view is not None:
                self._flush(results)
            records = {rank: data[KEY] for rank, data in
                       ((rank, published(result)) for rank, result in results.items())
                       if KEY in data}
            if not records:
                return
            if self._view is None:
                self._view = _make_view(sorted(results))
            self._view.update(records)
        except Exception:            # a progress bar must never be why training fails
            log.debug("progress display turned off for this wait", exc_info=True)
            self._broken = True

    def _flush(self, results: dict[int, Any]) -> None:
        """A rank's result can arrive before its last data message: wait for those, once."""
        for rank, result in results.items():
            if rank not in self._flushed and result.ready():
                result.wait_for_output(FLUSH_TIMEOUT)
                self._flushed.add(rank)


def _make_view(ranks: list[int]) -> "_WidgetView | _TextView":
    try:
        from IPython import get_ipython
        shell = get_ipython()
        if shell is not None and hasattr(shell, "kernel"):
            return _WidgetView(ranks)
    except ImportError:
        pass
    return _TextView(ranks)


class _WidgetView:
    """One IntProgress bar and a line of numbers per rank, drawn by JupyterLab."""

    def __init__(self, ranks: list[int]) -> None:
        import ipywidgets as w
        from IPython.display import display

        self.bars, self.texts = {}, {}
        rows = []
        for rank in ranks:
            self.bars[rank] = w.IntProgress(value=0, min=0, max=1, bar_style="info",
                                            layout=w.Layout(width="40%"))
            self.texts[rank] = w.Label("waiting")
            rows.append(w.HBox([w.Label(f"rank {rank}", layout=w.Layout(width="5em")),
                                self.bars[rank], self.texts[rank]]))
        box = w.VBox(rows)
        # The widget's own text form lists its current values, which depend on
        # timing; ours is fixed, so nbval compares the same line every run.
        display({"application/vnd.jupyter.widget-view+json":
                 {"model_id": box.model_id, "version_major": 2, "version_minor": 0},
                 "text/plain": headline(ranks)}, raw=True)

    def update(self, records: dict[int, dict]) -> None:
        for rank, record in records.items():
            bar = self.bars.get(rank)
            if bar is None:
                continue
            bar.max = max(1, record["total"])
            bar.value = min(record["step"], bar.max)
            if record["step"] >= record["total"]:
                bar.bar_style = "success"
            self.texts[rank].value = record_text(record)


class _TextView:
    """Outside Jupyter: a line per rank each time it passes a quarter of its steps."""

    def __init__(self, ranks: list[int]) -> None:
        self.quarters = {rank: -1 for rank in ranks}
        print(headline(ranks), flush=True)

    def update(self, records: dict[int, dict]) -> None:
        for rank, record in sorted(records.items()):
            quarter = 4 * record["step"] // max(1, record["total"])
            if quarter > self.quarters.get(rank, -1):
                self.quarters[rank] = quarter
                print(f"  rank {rank}: {record_text(record)}", flush=True)
