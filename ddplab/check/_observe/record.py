"""The record of one check on one rank: the ops its process groups carried out and the checker's marks.

``wire.recording()`` fills a ``Record`` (``Op``: one collective or p2p op;
``Mark``: a landmark the checker set, ``record.mark("backward starts")``), and
``schedule.Watch`` adds the marks of the checker's own hooks to the same
sequence. Ops and marks share one numbering, so the questions a check asks are
about order: ``between(a, b)``, ``pending_at(mark)``. ``plain()`` is what travels
to the kernel.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["Mark", "Op", "Record", "global_rank", "numel"]


@dataclass
class Op:
    """One op the process group carried out on this rank."""
    index: int                     # position in the record (ops and marks share the numbering)
    family: str                    # all_reduce, all_gather, reduce_scatter, broadcast, send, recv, ...
    via: str                       # c10d op (allreduce_), Backend method (allreduce) or recorder name
    layer: str                     # "dispatcher", "backend" or "flight"
    group: tuple | None            # the group's global ranks (None: unknown)
    peer: int | None = None        # p2p: the other rank, global (None: any source, or unknown)
    root: int | None = None        # broadcast, reduce, gather, scatter: the root, global
    numel: int = 0                 # elements this rank hands in
    start: float = 0.0             # time.perf_counter() when it was issued
    issued: float = 0.0            # ... when the call returned (for a blocking call: it finished)
    done: float | None = None      # the first moment the record saw it complete (None: never)
    waited: float | None = None    # when a wait() on its Work returned (None: nobody waited in Python)
    after: str | None = None       # the name of the last mark before it
    on_main: bool = True           # issued by the main thread
    flight: list = field(default_factory=list)   # the recorder's names for it (collectives)
    ns: tuple = (0, 0)             # time.time_ns() around the call (for the recorder's entries)
    thread: int = 0


@dataclass
class Mark:
    """A landmark the checker set: ``record.mark("backward starts")``."""
    index: int
    name: str
    time: float
    data: dict = field(default_factory=dict)


def numel(value: Any) -> int:
    import torch
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(numel(v) for v in value)
    return 0


class Record:
    """The ops and marks of one ``recording()`` block on this rank, in the order they began."""

    def __init__(self) -> None:
        self.events: list[Op | Mark] = []
        self.flight: dict = {"checked": False, "complete": True, "unexplained": [],
                             "unconfirmed": [], "disagree": []}
        self._pending: list[tuple[Op, Any, Any]] = []
        self._groups: dict[int, tuple[Any, tuple]] = {}
        self._works: dict[int, tuple] = {}     # op index -> its Work (kept for wait())
        self.main = threading.main_thread().ident
        self._last_mark: str | None = None
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    # ---------------------------------------------------------------- reading
    @property
    def ops(self) -> list[Op]:
        return [e for e in self.events if isinstance(e, Op)]

    @property
    def marks(self) -> list[Mark]:
        return [e for e in self.events if isinstance(e, Mark)]

    def first(self, name: str) -> Mark:
        """The first mark called ``name``; KeyError naming the marks there are."""
        for mark in self.marks:
            if mark.name == name:
                return mark
        raise KeyError(f"no mark {name!r} in this record; its marks: "
                       f"{sorted({m.name for m in self.marks})}")

    def named(self, name: str) -> list[Mark]:
        return [m for m in self.marks if m.name == name]

    def between(self, after: Mark | None = None, before: Mark | None = None) -> list[Op]:
        """The ops issued after mark ``after`` and before mark ``before`` (None: either end)."""
        lo = after.index if after is not None else -1
        hi = before.index if before is not None else len(self.events)
        return [op for op in self.ops if lo < op.index < hi]

    def pending_at(self, mark: Mark) -> list[Op]:
        """The ops issued before ``mark`` that the record had not seen complete when it was set."""
        return [op for op in self.ops
                if op.index < mark.index and (op.done is None or op.done > mark.time)]

    def plain(self) -> dict:
        """The record as plain data for the kernel: times in seconds from the record's start."""
        def op_row(op: Op) -> dict:
            row = asdict(op)
            for key in ("start", "issued", "done"):
                row[key] = None if row[key] is None else row[key] - self.t0
            del row["ns"], row["thread"]
            return row
        return {"ops": [op_row(op) for op in self.ops],
                "marks": [dict(asdict(m), time=m.time - self.t0) for m in self.marks],
                "flight": {k: [op_row(o) for o in v] if isinstance(v, list) else v
                           for k, v in self.flight.items()}}

    # ---------------------------------------------------------------- writing
    def mark(self, name: str, **data: Any) -> Mark:
        """Set a landmark now (after looking which pending ops have completed)."""
        now = time.perf_counter()
        self.poll(now)
        with self._lock:
            mark = Mark(len(self.events), name, now, data)
            self.events.append(mark)
            self._last_mark = name
        return mark

    def poll(self, now: float | None = None) -> None:
        """Note the ops that have completed since the last look."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            still = []
            for op, work, future in self._pending:
                try:
                    complete = future.done() if future is not None else work.is_completed()
                except Exception:         # a Work torch has torn down: it is over
                    log.debug("is_completed failed", exc_info=True)
                    complete = True
                if complete:
                    op.done = now
                else:
                    still.append((op, work, future))
            self._pending = still

    def forget_works(self) -> None:
        """Drop the Works kept for ``wait()`` (the record outlives its block; they need not)."""
        with self._lock:
            self._works.clear()
            self._pending = []         # what never completed keeps done=None

    def waited(self, work: Any, now: float) -> None:
        """A ``wait()`` on ``work`` returned: its op is complete (gloo's reduce_scatter Work never
        says so itself: ``is_completed()`` stays False and it has no future)."""
        with self._lock:
            for item in list(self._pending):
                if item[1] is work:
                    item[0].done = now
                    self._pending.remove(item)
            for index, (kept,) in self._works.items():
                op = self.events[index]
                if kept is work and isinstance(op, Op) and op.waited is None:
                    op.waited = now

    def group_ranks(self, pg: Any) -> tuple | None:
        import torch.distributed as dist
        key = id(pg)
        if key not in self._groups:          # the group is kept, so its id is not reused meanwhile
            try:
                ranks = tuple(dist.get_process_group_ranks(pg))
            except Exception:
                log.debug("no ranks for a process group", exc_info=True)
                ranks = None
            self._groups[key] = (pg, ranks)
        return self._groups[key][1]

    def add(self, op: Op, work: Any) -> None:
        with self._lock:
            op.index, op.after = len(self.events), self._last_mark
            self.events.append(op)
            if work is None:
                op.done = op.issued
                return
            self._works[op.index] = (work,)
            try:      # the future completes when torch's own waiters return; gloo's p2p has none,
                future = work.get_future()   # and its Work completes only in wait()
            except RuntimeError:
                future = None
            self._pending.append((op, work, future))


def global_rank(ranks: tuple | None, local: Any) -> int | None:
    if not isinstance(local, int) or local < 0:
        return None
    return local if ranks is None or local >= len(ranks) else ranks[local]
