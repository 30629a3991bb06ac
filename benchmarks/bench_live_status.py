"""What the live "blocked in ..." status costs a rank: a tight loop of small all_reduces.

While a cell runs, each rank's live pump thread looks at the main thread's
stack every ``ddplab.rank.live.INTERVAL`` seconds (``ddplab.rank.blocked``).
Nothing is wrapped, so the only cost to the rank's own code is that look
(the GIL, briefly, five times a second). A 2-rank gloo lab times N
``all_reduce`` calls of one float through ``lab.run``, with the look on and
off (``Pump.publish_status`` swapped for a no-op on the ranks), alternating;
it also times one look by itself, and counts the looks that said "blocked"
during the loop (none should: every call is a new one).

Run: ``.venv/bin/python benchmarks/bench_live_status.py [--repeat 9] [--calls 3000]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ddplab.lab.cluster import Lab, LabSpec


def tight_loop(n: int) -> float:
    """On a rank: wall seconds per ``all_reduce`` of one float, over ``n`` calls."""
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - began) / n


def set_watch(on: bool) -> list[str]:
    """On a rank: turn the status look on (counting what it says) or off; what it said so far."""
    from ddplab.rank import live
    if not hasattr(live, "bench_state"):      # kept on the rank between lab.run calls
        live.bench_state = {"said": [], "real": live.Pump.publish_status}
    state = live.bench_state
    if on:
        def counted(self, real=state["real"], said=state["said"]):
            real(self)
            if self._status:
                said.append(self._status)
        live.Pump.publish_status = counted
    else:
        live.Pump.publish_status = lambda self: None
    return list(state["said"])


def one_look(n: int) -> float:
    """On a rank: seconds one look at the main thread's stack takes, from a side thread."""
    import threading

    from ddplab.rank import blocked
    watch, took = blocked.Watch(threading.get_ident()), []

    def look() -> None:
        began = time.perf_counter()
        for _ in range(n):
            watch.look()
        took.append((time.perf_counter() - began) / n)

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    return took[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    print(f"2 ranks, gloo on CPU; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f} at the start; medians of {args.repeat}.", flush=True)
    lab = Lab(LabSpec(world_size=2, backend="gloo", timeout=900, grace=2.0, pg_timeout=1800,
                      debug=False), gpus=0)
    lab.start()
    try:
        off, on = [], []
        for _ in range(args.repeat):
            lab.run(set_watch, False)
            off.append(max(lab.run(tight_loop, args.calls)))
            lab.run(set_watch, True)
            on.append(max(lab.run(tight_loop, args.calls)))
        said = lab.run(set_watch, True)
        look = statistics.median(max(lab.run(one_look, 1000)) for _ in range(3))
        a, b = statistics.median(off) * 1e6, statistics.median(on) * 1e6
        print(f"all_reduce of one float, µs per call (slowest rank), {args.calls} calls a run:")
        print(f"  status look off {a:7.1f}   on {b:7.1f}   difference {b - a:+6.1f} "
              f"({(b / a - 1) * 100:+.1f} %)")
        print(f"  one look at the main thread's stack: {look * 1e6:.1f} µs, every "
              f"0.2 s = {look / 0.2 * 100:.4f} % of a rank's time")
        print(f"  looks that said 'blocked' during the tight loops: {sum(map(len, said))}")
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
