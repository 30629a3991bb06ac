"""Live output in the notebook while ranks run: one area per rank, in rank order.

Each rank publishes its *screen* (its last lines, ``\\r`` already applied; see
``ddplab.rank.live``) while a cell runs. The kernel's wait loop hands the
latest screens to a ``Board``, which shows one area per rank, rank 0 first,
each under its ``[rank N]`` label with a short status, updated in place with
IPython's display ids (never interleaved by arrival). The status is
``running``, ``finished`` or ``failed``, or what the rank reports while it
sits in one torch.distributed call: ``blocked in recv, cell line 3``.

The areas are scaffolding, not output: they are made only once some rank has
printed (or is blocked) and the cell has run ``OPEN_AFTER`` seconds, they start and end empty
(``display_data`` with no data, which nbval and ``ddplab grade`` skip and
``tools/clean_notebook.py`` removes), and when
the cell ends they are emptied and the final rank-ordered text is printed as
before. So a stored notebook is the same with or without them. Outside a
Jupyter kernel (a terminal, a script) there is no board: output comes out in
rank order when the cell ends, as it always did.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from ..rank.live import KEY, STATUS_KEY
from . import display
from .channel import published

#: Lines of a rank's screen shown in its live area.
LINES = 20
#: Seconds a wait runs before its areas may open: quick cells never get any, so
#: their stored output cannot even hold an empty area.
OPEN_AFTER = 1.0
_ids = itertools.count()
log = logging.getLogger(__name__)


def screen(result: Any) -> str | None:
    """The latest screen a rank published for ``result`` (an AsyncResult), if any."""
    try:
        return published(result).get(KEY)
    except Exception:            # polled every wait step: a bad message only loses a screen
        log.debug("no live screen in this result", exc_info=True)
        return None


def reported(result: Any) -> str:
    """What a rank last said of itself for ``result``: "" or ``blocked in send, cell line 1``."""
    try:
        return published(result).get(STATUS_KEY) or ""
    except Exception:            # polled every wait step: a bad message only loses a status
        log.debug("no live status in this result", exc_info=True)
        return ""


def status(task: Any) -> str:
    """``running``, ``blocked in ...``, ``finished`` or ``failed``, from a cluster ``_Task``."""
    if task.outcome is None:
        return reported(task.result) or "running"
    return "finished" if task.outcome["ok"] else "failed"


class Board:
    """The live areas of one wait. ``update`` often, ``close`` once at the end."""

    def __init__(self) -> None:
        self.enabled = display.in_kernel()
        self._begin = time.monotonic()
        self._ids: list[str] = []
        self._shown: list[str] = []

    def update(self, tasks: list[Any], notes: dict[int, str] | None = None) -> None:
        """Show each task's rank, status and screen; tasks in rank order.

        ``notes``: a status the kernel knows better than the rank, by rank
        (``in the debugger``, from ``ddplab.lab.debugger``).
        """
        if not self.enabled:
            return
        notes = notes or {}
        try:
            ordered = sorted(tasks, key=lambda t: t.rank)
            screens = [screen(t.result) for t in ordered]
            statuses = [notes.get(t.rank) or status(t) for t in ordered]
            if not self._ids:
                worth = any(screens) or bool(notes) or any(s.startswith("blocked") for s in statuses)
                if not worth or time.monotonic() - self._begin < OPEN_AFTER:
                    return
                self._open(len(ordered))
            for i, (task, text, state) in enumerate(zip(ordered, screens, statuses)):
                if i >= len(self._ids):
                    break
                lines = (text or "").rstrip("\n").split("\n")[-LINES:] if text else []
                body = "\n".join([display.rank_label(task.rank, f"({state})")] + lines)
                if body != self._shown[i]:
                    self._shown[i] = body
                    self._send(self._ids[i], {"text/plain": body}, update=True)
        except Exception:            # a live view must never be why a cell fails
            log.debug("live areas turned off for this wait", exc_info=True)
            self.enabled = False

    def _open(self, n: int) -> None:
        base = f"ddplab-live-{os.getpid()}-{next(_ids)}"
        self._ids = [f"{base}-{i}" for i in range(n)]
        self._shown = [""] * n
        for display_id in self._ids:
            self._send(display_id, {}, update=False)

    def close(self) -> None:
        """Empty every area: the final output follows, printed as before."""
        for display_id in self._ids:
            try:
                self._send(display_id, {}, update=True)
            except Exception:    # the final output follows anyway; an area left showing is cosmetic
                log.debug("could not empty live area %s", display_id, exc_info=True)
        self._ids, self._shown = [], []

    @staticmethod
    def _send(display_id: str, data: dict, update: bool) -> None:
        from IPython.display import publish_display_data
        publish_display_data(data=data, transient={"display_id": display_id}, update=update)
