"""What a call's watchers cost: the round trip of an empty ``lab.run``, with and without them.

A call's wait runs the watchers its lab chose (``ddplab.lab.watchers``): the notebook's front
(progress bars, live areas, the debugger's prompts) and the stall watch (what the timeout asks
before it calls ranks hung). A lab attached to another's ranks (the grader's) runs none.
Measured, side by side and in turn, on the same engines:

1. raw ipyparallel ``apply_sync`` of an empty function (the floor);
2. ``lab.run(nothing)`` with the lab's watchers (what a notebook's lab does);
3. ``lab.run(nothing)`` with none (what an attached lab does), where this checkout has
   watchers to leave out (``Calls.watchers``); on a checkout before them, the row is absent.

Outside a Jupyter kernel the live areas never open and no rank reports progress, so what is
timed is the watchers' bookkeeping each call: made, started, ticked, stopped.

Run: ``.venv/bin/python benchmarks/bench_calls.py [--world-size 2] [--calls 300]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _nothing() -> None:
    return None


def round_trips(lab, calls: int) -> dict[str, float]:
    """Median seconds per empty call, each way, the ways taken in turn."""
    view = lab.engines.engine_set.view(tuple(lab.ranks))
    ways = {"raw ipyparallel apply_sync": lambda: view.apply_sync(_nothing),
            "lab.run, the lab's watchers": lambda: lab.run(_nothing)}
    chosen = getattr(lab.calls, "watchers", None)
    if chosen is not None:
        def bare() -> None:
            lab.calls.watchers = ()
            try:
                lab.run(_nothing)
            finally:
                lab.calls.watchers = chosen
        ways["lab.run, no watchers"] = bare
    for way in ways.values():           # warm up every way
        for _ in range(5):
            way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(calls):
        for name, way in ways.items():
            began = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    import ddplab
    print(f"load average {os.getloadavg()[0]:.1f}")
    with ddplab.start(world_size=args.world_size, backend="gloo") as lab:
        trips = round_trips(lab, args.calls)
    raw = trips["raw ipyparallel apply_sync"]
    print(f"round trip of an empty call on {args.world_size} ranks (median of {args.calls}, in turn):")
    for name, s in trips.items():
        print(f"  {name:30} {s * 1e3:7.3f} ms  {s / raw:5.2f}x raw  (+{(s - raw) * 1e3:.3f} ms)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
