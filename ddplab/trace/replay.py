"""A recorded trace re-timed at another world size, by the α-β model: ``tr.replay(...)``.

    with lab.trace() as tr:                       # recorded on 2 ranks
        lab.run(step)
    fit = ddplab.bench.fit_ring(results)          # this lab's α and β
    big = tr.replay(world_size=8, **fit)          # the same step, were there 8 ranks
    big; big.save("step_at_8.json")               # a Trace: the picture, Perfetto, summary

The trace is read as a dependency graph:

- each rank's ops in the order it called them; the time between one call's return
  and the next call is the rank's own work (compute), kept as recorded;
- collectives matched across ranks as ``tr.collectives()`` matches them (the k-th
  on a group on each rank belong together): one starts when its last rank arrives
  and takes the α-β time of that collective at the new size (``ddplab.plan.network``);
- a blocking send/recv starts when both sides have come and takes α + bytes·β;
- an async op (``isend``, ``async_op=True``, DDP's bucket all_reduces) returns as
  quickly as it did, and a ``wait`` on it ends when it is complete.

Collectives on the whole world are timed on ``world_size`` ranks; those on a
subgroup keep its size. The lanes are the recorded ranks: at 8 ranks the lanes of
ranks 0 and 1 stand for all eight (every rank does the same work in data
parallelism). What is not replayed: contention for the network or the CPU, and
compute that would change with the world size (a smaller shard per rank).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .events import Event, event, instances

__all__ = ["cost", "replay"]


def cost(e: Event, n: int, alpha: float, beta: float) -> float:
    """α-β seconds of one recorded op on ``n`` ranks (its ``nbytes``: what this rank passed in)."""
    from ..plan.network import Network

    network = Network.from_bench({"alpha": alpha, "beta": beta})
    op = e.op
    if e.kind == "p2p":
        return network.seconds("send", e.nbytes, 2)
    if op.startswith("all_reduce"):
        return network.seconds("all_reduce", e.nbytes, n)
    if op.startswith("all_gather") and not op.endswith("object"):
        return network.seconds("all_gather", e.nbytes * n, n)      # each rank passes in its piece
    if op.startswith(("reduce_scatter", "all_to_all")):
        return network.seconds("reduce_scatter", e.nbytes, n)
    if op == "barrier":
        return network.seconds("barrier", 0, n)
    return network.seconds("broadcast", e.nbytes, n)              # broadcast, reduce, (s)gather, objects


def replay(trace: Any, world_size: int, alpha: float, beta: float,
           **ignored: Any) -> tuple[list[Event], list[Event], str]:
    """``trace``'s events and compute spans re-timed at ``world_size`` ranks with α (s per
    message) and β (s per byte), and a line saying so: what ``Trace.replay`` makes its new
    trace of. ``ignored`` takes the rest of a ``fit_ring``/``machine`` dict."""
    from ..plan.inputs import alpha_beta

    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"ddplab: tr.replay needs world_size, a whole number of ranks >= 1, got "
                          f"world_size={world_size!r}. Take alpha and beta from "
                          f"ddplab.bench.fit_ring(results): tr.replay(world_size=8, **fit).")
    alpha, beta = alpha_beta({"alpha": alpha, "beta": beta}, "ddplab: tr.replay")
    events = trace.require_events()
    recorded = len(trace.ranks)
    size = {id(e): (world_size if e.group is None or len(e.group) >= recorded else len(e.group))
            for e in events}
    instance_of: dict[int, list[Event]] = {}
    for members in instances(events, ordered=False):
        for e in members:
            instance_of[e.index] = members
    lanes = {r: [e for e in events if e.rank == r] for r in trace.ranks}
    new_start: dict[int, float] = {}
    new_end: dict[int, float] = {}
    complete: dict[int, float] = {}            # when each op was over, in the replay
    position = dict.fromkeys(lanes, 0)
    clock = {r: (lane[0].start if lane else 0.0) for r, lane in lanes.items()}   # new time
    last_end = {r: (lane[0].start if lane else 0.0) for r, lane in lanes.items()}  # recorded time

    def over(e: Event) -> float | None:
        """When ``e``'s communication is done in the replay, or None if not known yet."""
        if e.index in complete:
            return complete[e.index]
        if e.open or any(m.open for m in instance_of.get(e.index, ())):
            return None                     # stuck when the trace was read: it never completes
        if e.kind == "collective" and e.index in instance_of:
            members = instance_of[e.index]
            if all(m.index in new_start for m in members):
                done = max(new_start[m.index] for m in members) + cost(e, size[id(e)], alpha, beta)
                for m in members:
                    complete[m.index] = done
                return done
            return None
        if e.kind == "p2p" and e.match is not None:
            other = events[e.match]
            if other.index in new_start:
                done = max(new_start[e.index], new_start[other.index]) + cost(e, 2, alpha, beta)
                complete[e.index] = complete[other.index] = done
                return done
            return None
        complete[e.index] = new_start[e.index] + e.duration       # local, unmatched, setup: as recorded
        return complete[e.index]

    progress = True
    while progress:
        progress = False
        for r, lane in lanes.items():
            while position[r] < len(lane):
                e = lane[position[r]]
                if e.index not in new_start:
                    new_start[e.index] = clock[r] + max(0.0, e.start - last_end[r])
                if e.kind == "wait" and e.of is not None:
                    done = over(events[e.of])
                    end = None if done is None else max(done, new_start[e.index] + 1e-7)
                elif e.blocking or e.kind not in ("collective", "p2p"):
                    end = over(e)
                else:                                 # async: returns as it did, completes later
                    end = new_start[e.index] + e.duration
                if end is None:
                    break                             # waits for another rank to come
                new_end[e.index] = end
                clock[r], last_end[r] = end, e.end
                position[r] += 1
                progress = True
    stuck = [lane[position[r]] for r, lane in lanes.items() if position[r] < len(lane)]
    hung = bool(getattr(trace, "hung", False))
    if stuck and not hung:
        raise ConfigError(f"ddplab: tr.replay cannot order this trace: rank {stuck[0].rank}'s "
                          f"{stuck[0].op} waits for an op no rank reaches (a trace cut short by a "
                          f"hang?). Replay a trace that ran to its end.")
    for e in stuck:          # a hang stays a hang: stuck as long as it was when the trace was read
        new_end[e.index] = new_start[e.index] + e.duration
    open_now = {e.index for e in stuck}
    events = [e for e in events if e.index in new_end]     # a hung trace: what its ranks reached
    for e in events:                                  # async ops never waited on
        over(e)
    waited = {e.index: max(0.0, max(new_start.get(m.index, new_start[e.index]) for m in instance_of[e.index])
                           - new_start[e.index])
              for e in events if e.blocking and e.index in instance_of and e.index not in open_now}
    for e in events:
        if e.index in open_now:
            continue
        if e.kind == "wait" or (e.blocking and e.kind == "p2p" and e.match is not None):
            partner = new_start[e.match] if e.kind == "p2p" else new_end[e.index]
            waited[e.index] = min(max(0.0, partner - new_start[e.index]),
                                  new_end[e.index] - new_start[e.index])
    how = f"replayed at {world_size} ranks, alpha={alpha:.3g} s, beta={beta:.3g} s/B"
    if hung:
        how += ", up to the hang it was recorded in (the stuck calls never complete)"
    return (_moved(events, new_start, new_end, complete, waited, open_now),
            _moved_compute(trace.compute, lanes, new_start), how)


def _moved(events: list[Event], start: dict, end: dict, complete: dict, waited: dict,
           stuck: set) -> list[Event]:
    out = []
    for e in events:
        row = {name: getattr(e, name) for name in Event.__dataclass_fields__}
        row.update(start=start[e.index], end=end[e.index], waited=waited.get(e.index, 0.0),
                   open=e.index in stuck)
        if e.index in stuck:
            row["done"] = None
        elif not e.blocking and e.kind in ("collective", "p2p"):
            row["done"] = complete.get(e.index, end[e.index])
        out.append(event(e.index, row))
    return out


def _moved_compute(compute: list[Event], lanes: dict, start: dict) -> list[Event]:
    """Each compute span shifted as far as the last op its rank began before it."""
    out = []
    for c in compute:
        before = [e for e in lanes.get(c.rank, []) if e.start <= c.start]
        if before and before[-1].index not in start:
            continue                                  # after a hang, past where the rank got
        shift = start[before[-1].index] - before[-1].start if before else 0.0
        row = {name: getattr(c, name) for name in Event.__dataclass_fields__}
        row.update(start=c.start + shift, end=c.end + shift)
        out.append(event(-1, row))
    return out
