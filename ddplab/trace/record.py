"""A timeline of what the ranks' torch.distributed calls did: who waited for whom.

    with lab.trace() as tr:                # every rank records while the block runs
        lab.run(step)                      # or %%ranks cells, lab.run_cell, ...
    tr                                     # the picture: one lane per rank, time left to right
    tr.events                              # one Event per operation, on one clock
    tr.save("trace.json")                  # open it in https://ui.perfetto.dev or chrome://tracing

    %%ranks --trace                        # the same for one cell, picture under it

What is recorded (see ``ddplab.rank.trace`` for how): every ``send``/``recv``,
``isend``/``irecv`` and the ``wait`` on their Work, every collective and
object collective, ``barrier``, ``init_process_group``/``destroy_process_group``/
``new_group``, the ops torch issues itself from C++ (DDP's gradient-bucket
all_reduces during ``backward``, its broadcast of rank 0's weights), and each
``backward`` call and ``ddplab.trace.region(name)`` as compute. Nothing is
installed on a rank outside a trace.

Clocks. Each rank stamps with ``time.perf_counter()`` and converts to its
wall clock (``time.time()``) through one pair of readings taken when the trace
starts. Ranks whose machine is the kernel's (same ``boot_id``: one kernel, one
clock) need nothing more: their times agree to a microsecond. For ranks on
other hosts ddplab measures each clock's offset from the kernel's with five
round trips (Cristian's method) and subtracts it; ``tr.clock[rank]`` holds
the offset and its error bound, half the shortest round trip (a few ms
through ipyparallel). Hosts kept in step by NTP/chrony usually agree better
than that already, and the offsets then come out near zero.

Times in ``tr.events`` are seconds since the trace started.

Big traces. The ranks send their records as columns and ``stop`` analyses them
as columns (``ddplab.trace.events``: who matched whom, who waited how long);
the ``Event`` objects are made when ``tr.events`` is first read, and the
picture of a big trace reads the columns (``tr.columns()``) and makes none.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, DdplabError, HangError
from ..rank import trace as rank_trace
from ..rank.trace import region
from .events import Event, analyse, as_events, event, gather, instances

__all__ = ["Clock", "Event", "Trace", "Zoom", "last", "region", "set_last", "uneven_work"]
_last: Trace | None = None
_recording: dict[int, Trace] = {}      # id(lab) -> its trace that is recording now
log = logging.getLogger(__name__)


@dataclass
class Clock:
    """How one rank's times were put on the kernel's clock."""
    offset: float = 0.0            # seconds this rank's clock is ahead of the kernel's
    error: float = 0.0             # the offset is right within +- this
    how: str = "same machine"


class Trace:
    """Record the ranks' torch.distributed operations; make one with ``lab.trace()``."""

    # What the ranks sent, as analysed columns (``ddplab.trace.events``); the first read
    # of ``events`` makes the Events from them.
    _columns: dict[str, list] | None = None
    _events: list[Event] | None = None

    def __init__(self, lab: Any, ranks: Any = None, align: str = "auto") -> None:
        if align not in ("auto", "ping"):
            raise ConfigError(f"ddplab: lab.trace(align=...) is 'auto' or 'ping', got {align!r}.")
        self.lab, self.align = lab, align
        self.ranks = lab.check_ranks(ranks)
        self.events: list[Event] | None = None
        self.compute: list[Event] = []
        self.clock: dict[int, Clock] = {}
        self.t0 = 0.0
        self.running = False
        self.complete = False
        self.hung = False              # read after a hang (``salvage``): open calls are stuck
        self._over: dict[int, float] | None = None

    # ---------------------------------------------------------------- recording
    def start(self) -> Trace:
        other = _recording.get(id(self.lab))
        if other is not None:
            raise DdplabError("ddplab: a trace is already recording on this lab"
                              + (" (this one)" if other is self else "")
                              + "; one at a time. Stop it first (tr.stop(), or leave its "
                              "`with lab.trace()` block), or drop --trace inside it.")
        self.t0 = time.time()
        infos = self.lab.run(rank_trace.start, ranks=self.ranks)
        self.running = True
        _recording[id(self.lab)] = self
        here = rank_trace.boot_id()
        far = [r for r, info in infos.items() if info["boot_id"] != here or self.align == "ping"]
        self.clock = {r: Clock() for r in self.ranks}
        if far:
            self.clock.update(_measure_offsets(self.lab, far))
        return self

    def stop(self) -> Trace:
        """Stop recording on every rank and collect what it recorded."""
        global _last
        if not self.running:
            raise DdplabError("ddplab: this trace is not recording; start it with tr.start() "
                              "or `with lab.trace() as tr:`.")
        self.running = False
        _recording.pop(id(self.lab), None)
        results = self.lab.run(rank_trace.stop, ranks=self.ranks)
        self._build(results)
        self.complete = all(results[r]["recorded"] for r in self.ranks)
        _last = self
        return self

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            self.stop()
            return
        if not isinstance(exc, HangError):
            try:                  # a cell failed: keep what the ranks recorded, if they can say
                self.stop()
                return
            except DdplabError:   # the ranks are stuck: read them as after a hang
                log.debug("trace: the ranks cannot stop it; reading what they recorded",
                          exc_info=True)
        self.salvage()

    def salvage(self) -> Trace:
        """After a hang: keep what each rank recorded up to it, the stuck calls open-ended.

        A stuck rank's main thread cannot run the kernel's ``stop``; a thread of the
        rank answers instead (``lab.engines.recorded``, the side channel the flight
        recorder uses). Ranks that cannot answer (another host) are left out and the
        trace says it is incomplete. Recording goes on on the ranks until ``lab.restart()``.
        """
        global _last
        self.running = False
        _recording.pop(id(self.lab), None)
        answers = self.lab.engines.recorded(self.ranks, time.monotonic() + 5)
        empty = {"events": [], "compute": [], "recorded": False}
        results = {r: answers.get(r) or empty for r in self.ranks}
        self._build(results)
        self.complete = all(results[r]["recorded"] for r in self.ranks)
        self.hung = True
        _last = self
        return self

    @classmethod
    def made(cls, events: list[Event], compute: list[Event], ranks: list[int], how: str,
             hung: bool = False) -> Trace:
        """A trace made rather than recorded (``tr.replay``): these events, no lab behind it;
        ``how`` says where its times come from (kept in ``tr.clock``, shown by Perfetto);
        ``hung``: it ends in a hang (its open calls are stuck)."""
        trace = cls.__new__(cls)
        trace.lab, trace.align, trace.ranks = None, "auto", list(ranks)
        trace.events, trace.compute = events, sorted(compute, key=lambda e: (e.rank, e.start))
        trace.clock = {r: Clock(0.0, 0.0, how) for r in ranks}
        trace.t0, trace.running, trace.complete, trace.hung = 0.0, False, True, hung
        return trace

    def replay(self, world_size: int, alpha: float, beta: float, **fit: Any) -> Trace:
        """This trace re-timed at ``world_size`` ranks by the α-β model (``ddplab.trace.replay``):
        ``tr.replay(world_size=8, **ddplab.bench.fit_ring(results))``."""
        from .replay import replay
        events, compute, how = replay(self, world_size, alpha, beta, **fit)
        made = Trace.made(events, compute, self.ranks, how, hung=self.hung)
        made.complete = self.complete
        return made

    # ---------------------------------------------------------------- the data
    @property
    def events(self) -> list[Event] | None:
        """One Event per operation, rank by rank, each rank's in the order it began them;
        None until the trace has stopped."""
        if self._events is None and self._columns is not None:
            self._events = as_events(self._columns)
        return self._events

    @events.setter
    def events(self, events: list[Event] | None) -> None:
        self._events, self._columns, self._over = events, None, None

    @property
    def collected(self) -> bool:
        """Whether the trace holds what the ranks recorded (it stopped, or was read after a
        hang); unlike ``tr.events is not None``, asking makes no Event."""
        return self._events is not None or self._columns is not None

    def _build(self, results: dict[int, dict]) -> None:
        # The lab's rank numbers (a bare rank may not have joined a group yet), on one clock.
        shifts = {rank: self.t0 + self.clock[rank].offset for rank in self.ranks}
        columns = gather(results, shifts)
        analyse(columns)
        self.events = None
        self._columns = columns
        compute = [dict(c, rank=rank, start=c["start"] - shift, end=c["end"] - shift)
                   for rank, shift in shifts.items() for c in results[rank]["compute"]]
        self.compute = sorted((event(-1, c) for c in compute), key=lambda e: (e.rank, e.start))

    def columns(self) -> dict[str, list]:
        """The events as columns: per Event field (``index`` aside: it is the position),
        its value for every event, in ``tr.events`` order. What the picture of a big
        trace reads: no Event is made."""
        if self._columns is not None:
            return self._columns
        events = self.require_events()
        return {name: [getattr(e, name) for e in events] for name in Event.__dataclass_fields__}

    def require_events(self) -> list[Event]:
        if not self.collected:
            raise DdplabError("ddplab: this trace has no events yet: use `with lab.trace() as tr:` "
                              "and look at tr after the block.")
        return self.events

    def on(self, rank: int) -> list[Event]:
        """The events of one rank, in the order it called them."""
        return [e for e in self.require_events() if e.rank == rank]

    def find(self, op: str, rank: int | None = None) -> list[Event]:
        """The events of one op (``"send"``, ``"all_reduce"``), on one rank or all."""
        return [e for e in self.require_events() if e.op == op and (rank is None or e.rank == rank)]

    def collectives(self) -> list[list[Event]]:
        """Each collective call as the list of its events, one per rank, in call order."""
        return instances(self.require_events())

    def straggler(self) -> int | None:
        """The rank the others waited for in collectives, or None if nobody waited."""
        caused: dict[int, float] = defaultdict(float)
        for instance in self.collectives():
            if len(instance) < 2:
                continue
            last = max(instance, key=lambda e: e.start)
            caused[last.rank] += sum(e.waited for e in instance if e is not last)
        if not caused or max(caused.values()) <= 0:
            return None
        return max(caused, key=caused.get)

    @property
    def elapsed(self) -> float:
        """Seconds from the first recorded start to the last end, over every rank."""
        items = self.require_events() + self.compute
        return max((max(e.end, self.over(e)) for e in items), default=0.0) - \
            min((e.start for e in items), default=0.0)

    def zoom(self, start: float | None = None, end: float | None = None,
             after: str | None = None) -> Zoom:
        """The picture of one stretch of time (seconds since the trace started).

        ``after="barrier"`` keeps, on each rank, what came after its last ``barrier``:
        ranks begin a ``lab.run`` milliseconds apart, and a barrier lines them up.
        """
        events = self.require_events()
        cutoff = {r: -1e9 if start is None else start for r in self.ranks}
        if after is not None:
            ends = {e.rank: e.end for e in events if e.op == after}   # the last one per rank
            if not ends:
                raise ConfigError(f"ddplab: tr.zoom(after={after!r}): this trace has no {after!r}. "
                                  f"Ops in it: {', '.join(sorted({e.op for e in events}))}.")
            cutoff.update(ends)
        return Zoom(self, cutoff, 1e9 if end is None else end)

    def over(self, event: Event) -> float:
        """When an op was over, at the latest: ``done`` if known, else the end of the first
        wait on it, else when its call returned."""
        if event.done is not None:
            return event.done
        if self._over is None:            # once: per op, the end of its first wait
            self._over = {}
            for w in self.require_events():
                if w.kind == "wait" and w.of is not None:
                    self._over[w.of] = min(w.end, self._over.get(w.of, w.end))
        return self._over.get(event.index, event.end) if event.index >= 0 else event.end

    # ---------------------------------------------------------------- the forms
    def summary(self) -> str:
        from .picture import summary
        return summary(self)

    def __repr__(self) -> str:
        if not self.collected:
            return f"<ddplab.Trace of ranks {self.ranks}: {'recording' if self.running else 'not started'}>"
        return self.summary()

    def _repr_html_(self) -> str | None:
        if not self.collected:
            return None
        from .bins import html
        return html(self)

    def to_chrome(self) -> dict:
        """The trace in Chrome's trace-event format (what Perfetto and chrome://tracing read)."""
        from .chrome import chrome
        return chrome(self)

    def save(self, path: str) -> str:
        """Write the Chrome/Perfetto trace-event JSON to ``path``; returns the path."""
        with open(path, "w") as f:
            # One string, written once: json.dump's many small writes are several times slower.
            f.write(json.dumps(self.to_chrome(), separators=(",", ":")))
        return path


class Zoom:
    """Part of a trace, drawn and summarised like the whole (``tr.zoom``).

    ``cutoff[rank]``: from when on that rank's ops are kept; ``end``: until when.
    """

    def __init__(self, trace: Trace, cutoff: dict[int, float], end: float) -> None:
        self.trace, self.cutoff, self.end = trace, cutoff, end

    def keeps(self, event: Event) -> bool:
        return self.cutoff.get(event.rank, -1e9) < event.start <= self.end

    def __repr__(self) -> str:
        from .picture import summary
        return summary(self.trace, keep=self.keeps)

    def _repr_html_(self) -> str:
        from .bins import html
        return html(self.trace, keep=self.keeps)


def last() -> Trace | None:
    """The trace that stopped most recently in this kernel (what checkers read)."""
    return _last


def set_last(trace: Trace | None) -> None:
    """Make ``trace`` what ``last()`` returns: the grader's copy of a kernel's last trace."""
    global _last
    _last = trace


def _measure_offsets(lab: Any, ranks: list[int], rounds: int = 5) -> dict[int, Clock]:
    """Cristian's method: each rank's clock minus the kernel's, from the shortest round trip."""
    best: dict[int, tuple[float, float]] = {}
    for _ in range(rounds):
        before = time.time()
        stamps = lab.run(rank_trace.now, ranks=ranks)
        after = time.time()
        for rank, stamp in stamps.items():
            trip = after - before
            if rank not in best or trip < best[rank][1]:
                best[rank] = (stamp - (before + after) / 2, trip)
    return {r: Clock(offset, trip / 2, "round trips through ipyparallel")
            for r, (offset, trip) in best.items()}


def uneven_work(seconds: dict | None = None, seed: int = 0) -> float:
    """On a rank: some work of its own, more on one rank than the others, then an all_reduce.

    For the "which rank is the straggler?" exercise: which rank works longest
    is not in the notebook's code, and the timeline shows it. ``seconds`` maps
    rank -> seconds of work to choose it yourself. Returns this rank's seconds.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    slow = (seed * 7 + 2) % world
    mine = (seconds or {}).get(rank, 0.6 if rank == slow else 0.05)
    with region("work"):
        time.sleep(mine)
    dist.all_reduce(torch.tensor([mine]))
    return mine
