"""What the live "blocked in ..." status costs a rank: a tight loop of small all_reduces.

While a cell runs, each rank's live pump thread looks at the main thread's
stack every ``ddplab.rank.live.INTERVAL`` seconds (``ddplab.rank.blocked``).
Nothing is wrapped, so the only cost to the rank's own code is that look
(the GIL, briefly, five times a second). A 2-rank gloo lab times N
``all_reduce`` calls of one float through ``lab.run``, with the look off
(``Pump.publish_status`` swapped for a no-op on the ranks), on as in a lab,
and on every 2 ms (100 times as often, so that a cost too small to see at
0.2 s would show). Runs alternate with "off" runs, and each is compared with
the mean of the off runs either side of it (the load of a shared machine
changes between runs); wall clock, and the CPU time of the ranks' main
threads. It also times one look by itself, and counts the looks that said
"blocked" during the loops (none should: every call is a new one).

Measured on the shared 2-core machine (load average ~7), 2026-11-23, 8,000
calls a run, medians of 7: see the table in benchmarks/README.md: off
157.9 µs, on 170.1 µs (paired 0.911), x100 163.1 µs (paired 1.028): noise.

Run: ``.venv/bin/python benchmarks/bench_live_status.py [--repeat 9] [--calls 8000]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ddplab.lab import Lab, LabSpec


def tight_loop(n: int) -> tuple[float, float]:
    """On a rank: (wall, main-thread CPU) seconds per ``all_reduce`` of one float, over ``n`` calls."""
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.barrier()
    began, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - began) / n, (time.thread_time() - cpu) / n


def set_watch(on: bool, interval: float = 0.2) -> list[str]:
    """On a rank: turn the status look on (counting what it says) or off; what it said so far.

    ``interval``: how often the pump looks (``live.INTERVAL``, 0.2 s in a lab).
    """
    from ddplab.rank import live
    if not hasattr(live, "bench_state"):      # kept on the rank between lab.run calls
        live.bench_state = {"said": [], "real": live.Pump.publish_status}
    state = live.bench_state
    live.INTERVAL = interval
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
    parser.add_argument("--calls", type=int, default=8000)
    args = parser.parse_args()
    print(f"2 ranks, gloo on CPU; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f} at the start; medians of {args.repeat}.", flush=True)
    lab = Lab(LabSpec(world_size=2, backend="gloo", timeout=900, grace=2.0, pg_timeout=1800,
                      debug=False), gpus=0)
    lab.start()
    try:
        def timed(on: bool, interval: float = 0.2) -> tuple[float, float]:
            lab.run(set_watch, on, interval)
            results = lab.run(tight_loop, args.calls)
            return max(r[0] for r in results), max(r[1] for r in results)

        # off, on, off, x100, off, on, ...: each "on" run against the off runs either side.
        modes = {"on (every 0.2 s)": 0.2, "on, every 2 ms (x100)": 0.002}
        timed(False)                                         # warm up
        off = [timed(False)]
        runs = {m: [] for m in modes}
        ratios = {m: ([], []) for m in modes}
        for _ in range(args.repeat):
            for mode, interval in modes.items():
                runs[mode].append(timed(True, interval))
                off.append(timed(False))
                for i in (0, 1):
                    ratios[mode][i].append(runs[mode][-1][i] / ((off[-2][i] + off[-1][i]) / 2))
        said = lab.run(set_watch, True)         # back to the lab's own interval, 0.2 s
        look = statistics.median(max(lab.run(one_look, 1000)) for _ in range(3))
        print(f"all_reduce of one float, per call (slowest rank), {args.calls} calls a run; "
              f"wall µs and the main thread's CPU µs; 'paired': each run / the off runs either side:")
        print(f"  {'status look':<24} {'wall':>7} {'paired':>7} {'CPU':>7} {'paired':>7}")
        print(f"  {'off':<24} {statistics.median(r[0] for r in off) * 1e6:7.1f} {1:7.3f} "
              f"{statistics.median(r[1] for r in off) * 1e6:7.1f} {1:7.3f}")
        for mode in modes:
            print(f"  {mode:<24} {statistics.median(r[0] for r in runs[mode]) * 1e6:7.1f} "
                  f"{statistics.median(ratios[mode][0]):7.3f} "
                  f"{statistics.median(r[1] for r in runs[mode]) * 1e6:7.1f} "
                  f"{statistics.median(ratios[mode][1]):7.3f}")
        print(f"  one look at the main thread's stack: {look * 1e6:.1f} µs, every "
              f"0.2 s = {look / 0.2 * 100:.4f} % of a rank's time")
        print(f"  looks that said 'blocked' during the tight loops: {sum(map(len, said))}")
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
