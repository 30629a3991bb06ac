"""From what the ranks recorded to ``tr.events``: one clock, sends matched to recvs, waits.

Each rank sends its calls as columns, one list per field (``ddplab.rank.recorder``
says why: 100k dicts took seconds to ship). ``gather`` puts the ranks' columns end
to end on the kernel's clock; ``analyse`` adds ``match`` and ``waited`` to them;
``as_events`` turns them into ``Event`` objects, which ``Trace`` does only when
``tr.events`` is first read: stopping a 200k-op trace should cost what collecting
it costs, not the building of 200k objects nobody may look at.

Who waited how long, the rules ``analyse`` applies:

- a ``wait()`` waited all of its time;
- a blocking send or recv waited until its partner was posted (the k-th send from
  ``a`` to ``b`` with a tag on a group matches the k-th recv on ``b`` from ``a``);
- a blocking collective waited until the last rank arrived: the k-th collective on a
  group of one rank belongs with the k-th on that group of every other rank.
"""

from __future__ import annotations

import gc
from collections import defaultdict, deque
from dataclasses import MISSING, dataclass
from typing import Any

from ..rank.recorder import COLUMNS

__all__ = ["Event", "analyse", "as_events", "event", "gather", "instances"]

_SENDS = frozenset(("send", "isend", "send_object_list"))
_RECVS = frozenset(("recv", "irecv", "recv_object_list"))


@dataclass(frozen=True)
class Event:
    """One operation on one rank. Times are seconds since the trace started."""
    index: int                     # position in tr.events
    rank: int
    op: str                        # "send", "all_reduce", "wait", "backward", ...
    kind: str                      # "p2p", "collective", "wait", "setup" or "compute"
    start: float
    end: float                     # when the call returned
    peer: int | None = None        # p2p: the other rank (global rank)
    root: int | None = None        # broadcast/reduce/gather/scatter: the root
    nbytes: int = 0                # the tensor(s) this rank passed in; object ops: bytes moved
    group: tuple[int, ...] | None = None   # None: the whole world
    site: str | None = None        # "cell line 3"; "fn line 12" in a function given to lab.run
    source: str = "call"           # "call": the rank's code called it; "torch": torch did (DDP)
    blocking: bool = True
    done: float | None = None      # an async op: complete by then (the first time the rank
                                   # looked after it was; an upper bound), where known
    of: int | None = None          # a wait: index of the op it waited for
    waited: float = 0.0            # seconds of this call spent waiting for another rank
    match: int | None = None       # p2p: index of the matching send/recv
    tag: int = 0
    error: str | None = None
    open: bool = False             # still in the call when the trace was read (a hang):
                                   # ``end`` is then when it was read, not when it returned

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def finish(self) -> float:
        """When the operation was over: its completion if known, else when the call returned."""
        return self.done if self.done is not None else self.end


_FIELDS = tuple(Event.__dataclass_fields__)
_KNOWN = frozenset(_FIELDS) - {"index"}
_DEFAULTS = {name: f.default for name, f in Event.__dataclass_fields__.items()
             if f.default is not MISSING}


def _made(values: dict) -> Event:
    """An Event with these field values, built without ``Event.__init__``: a frozen
    dataclass sets each of its 20 fields through ``object.__setattr__``, which made
    building a 200k-op trace take seconds; this is one dict per event (frozen after)."""
    made = object.__new__(Event)
    object.__setattr__(made, "__dict__", values)
    return made


def event(index: int, row: dict) -> Event:
    """``row`` (a dict, as a compute span comes) as an Event, its unknown keys dropped."""
    values = dict(_DEFAULTS)
    values.update((key, value) for key, value in row.items() if key in _KNOWN)
    values["index"] = index
    if values.get("end") is None:
        values["end"] = values["start"]
    if values["group"] is not None:
        values["group"] = tuple(values["group"])
    return _made(values)


def _columns(shipped: Any) -> dict[str, list]:
    """A rank's events as columns: what ranks send (``recorder.packed`` columns), or
    (tests, a rank of an older ddplab) a list of dicts."""
    if isinstance(shipped, dict):
        return {key: [value["all"]] * value["n"] if isinstance(value, dict) else value
                for key, value in shipped.items()}
    return {key: [row.get(key, default) for row in shipped] for key, default in COLUMNS.items()}


def gather(results: dict[int, dict], shifts: dict[int, float]) -> dict[str, list]:
    """Every rank's columns end to end (rank by rank, each in the order it began them),
    times as seconds since the trace started: a rank's wall-clock times minus
    ``shifts[rank]``. Adds ``rank``; a wait's ``of`` becomes an index into the whole."""
    out: dict[str, list] = {key: [] for key in COLUMNS}
    out["rank"] = []
    for rank, shift in shifts.items():
        columns = _columns(results[rank]["events"])
        base, n = len(out["rank"]), len(columns["op"])
        out["rank"] += [rank] * n
        starts = [t - shift for t in columns["start"]]
        out["start"] += starts
        out["end"] += [s if t is None else t - shift for s, t in zip(starts, columns["end"])]
        out["done"] += [None if t is None else t - shift for t in columns["done"]]
        out["of"] += [None if of is None else of + base for of in columns["of"]]
        # JSON (a trace read after a hang) makes tuples lists; a group is a key below.
        out["group"] += [None if g is None else tuple(g) for g in columns["group"]]
        for key in COLUMNS.keys() - {"start", "end", "done", "of", "group"}:
            out[key] += columns.get(key) or [COLUMNS[key]] * n
    return out


def analyse(c: dict[str, list]) -> None:
    """Add ``match`` (p2p: the partner's index) and ``waited`` to the columns ``c``."""
    import numpy as np

    n = len(c["op"])
    ops, kinds, ranks, peers = c["op"], c["kind"], c["rank"], c["peer"]
    match: list = [None] * n
    queues: dict[tuple, deque[int]] = defaultdict(deque)
    for i in [i for i, op in enumerate(ops) if op in _SENDS and peers[i] is not None]:
        queues[(ranks[i], peers[i], c["group"][i], c["tag"][i])].append(i)
    for i in [i for i, op in enumerate(ops) if op in _RECVS and peers[i] is not None]:
        queue = queues.get((peers[i], ranks[i], c["group"][i], c["tag"][i]))
        if queue:
            j = queue.popleft()
            match[i], match[j] = j, i
    start, end = np.asarray(c["start"], dtype=float), np.asarray(c["end"], dtype=float)
    span = end - start
    waited = np.zeros(n)
    for i in [i for i, kind in enumerate(kinds) if kind in ("wait", "p2p")]:
        if kinds[i] == "wait":
            waited[i] = span[i]
        elif c["blocking"][i] and match[i] is not None:
            waited[i] = min(max(start[match[i]] - start[i], 0.0), span[i])
    # Collectives, vectorized: a 100k-call loop makes 100k instances per rank.
    ours = np.flatnonzero(np.asarray(kinds, dtype=object) == "collective")
    if len(ours):
        ids: dict = {}
        group = np.fromiter((ids.setdefault(c["group"][i], len(ids)) for i in ours), int, len(ours))
        rank = np.asarray(ranks, dtype=np.int64)[ours]
        # k: how many collectives on this group this rank made before this one.
        lane = group * (rank.max() + 1) + rank
        order = np.argsort(lane, kind="stable")          # stable: each lane in call order
        lanes = lane[order]
        first = np.r_[0, np.flatnonzero(np.diff(lanes)) + 1]
        k = np.empty(len(ours), dtype=np.int64)
        k[order] = np.arange(len(ours)) - np.repeat(first, np.diff(np.r_[first, len(ours)]))
        _, instance = np.unique(group * (k.max() + 1) + k, return_inverse=True)
        arrived = np.full(instance.max() + 1, -np.inf)
        np.maximum.at(arrived, instance, start[ours])       # when the last rank came
        blocking = np.asarray(c["blocking"], dtype=bool)[ours]
        own = np.clip(arrived[instance] - start[ours], 0.0, span[ours])
        waited[ours] = np.where(blocking, own, 0.0)
    c["match"], c["waited"] = match, waited.tolist()


def as_events(c: dict[str, list]) -> list[Event]:
    """The analysed columns as Events, ``index`` their position."""
    n = len(c["op"])
    c = dict(c, index=range(n))
    for name, default in _DEFAULTS.items():
        if name not in c:
            c[name] = [default] * n
    # 200k new objects would start the garbage collector's full passes over everything
    # again and again (half the time here); none of them can be part of a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return [_made(dict(zip(_FIELDS, values))) for values in zip(*(c[name] for name in _FIELDS))]
    finally:
        if collecting:
            gc.enable()


def instances(events: list[Event], ordered: bool = True) -> list[list[Event]]:
    """Collectives matched across ranks: the k-th on a group on each rank belong together;
    ``ordered``: sorted by when the first rank began each one."""
    per_rank: dict[tuple, list] = defaultdict(list)
    for e in events:
        if e.kind == "collective":
            per_rank[(e.group, e.rank)].append(e)
    grouped: dict[tuple, list] = defaultdict(list)
    for (group, _), items in per_rank.items():
        for k, e in enumerate(items):
            grouped[(group, k)].append(e)
    if not ordered:
        return list(grouped.values())
    return sorted(grouped.values(), key=lambda inst: min(e.start for e in inst))
