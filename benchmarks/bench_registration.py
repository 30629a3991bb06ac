"""How long a lab's engines wait for the controller to answer their registration, against the 5 s
after which ipyparallel's engine gives up by default (``IPEngine.timeout``; issue 42).

Each start of a ``--world-size`` lab is read from its own logs: per engine, from its
"Registering with controller" line to the controller's "accepting registration" of it.
An engine that waited more than 5 s would have exited under ipyparallel's default, and the
start then timed out with one engine missing; ddplab now lets it wait as long as the start
(``tests/test_slow_controller.py``). Prints the load average, each start's longest wait and
its ratio to 5 s, and each start's time against the start's own 60 s.

``--load N`` runs N busy Python loops beside the starts (as other work on a shared machine).

Run: ``.venv/bin/python benchmarks/bench_registration.py [--repeat 5] [--world-size 4] [--load 4]``
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import sys
import time

import ipyparallel as ipp

import ddplab
from ddplab import procs

IPYPARALLEL_TIMEOUT_S = 5.0
#: What ``ddplab.start`` waits for its engines by default (``engine_timeout``: max(60, timeout)).
START_TIMEOUT_S = 60.0
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) ")


def _when(line: str) -> float:
    return datetime.datetime.strptime(_STAMP.match(line)[1], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def longest_wait(folder: str) -> float:
    """The longest an engine of the lab in ``folder`` waited for its registration's answer (s)."""
    asked = {}
    for log in glob.glob(os.path.join(folder, "log", "ipengine-*.log")):
        with open(log) as f:
            lines = [line for line in f if "Registering with controller" in line]
        if lines:
            asked[log] = _when(lines[0])
    accepted = []
    for log in glob.glob(os.path.join(folder, "log", "ipcontroller-*.log")):
        with open(log) as f:
            accepted += [_when(line) for line in f if "accepting registration" in line]
    if not asked or len(accepted) < len(asked):
        raise RuntimeError(f"the logs in {folder} do not show every registration")
    # The k-th engine to ask is answered by the k-th acceptance, or later: a bound from below.
    return max(answer - ask for ask, answer in zip(sorted(asked.values()), sorted(accepted)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--load", type=int, default=0)
    args = parser.parse_args()
    busy = procs.Group([[sys.executable, "-c", "while True: pass"]] * args.load).start() \
        if args.load else None
    try:
        _starts(args)
    finally:
        if busy is not None:
            busy.close(grace=0)


def _starts(args: argparse.Namespace) -> None:
    folders: list[str] = []
    real = ipp.Cluster.start_engines

    async def noting_the_folder(self, *a, **k):
        folders.append(self.profile_dir)
        return await real(self, *a, **k)

    ipp.Cluster.start_engines = noting_the_folder
    print(f"{args.world_size}-rank starts beside {args.load} busy loops; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for run in range(args.repeat):
        begin = time.perf_counter()
        lab = ddplab.start(world_size=args.world_size, backend="gloo")
        took = time.perf_counter() - begin
        wait = longest_wait(folders[-1])
        lab.stop()
        print(f"  start {run + 1}: {took:5.2f} s = {took / START_TIMEOUT_S:4.2f}x the start's "
              f"{START_TIMEOUT_S:g} s; longest registration wait {wait:5.2f} s = "
              f"{wait / IPYPARALLEL_TIMEOUT_S:4.2f}x ipyparallel's {IPYPARALLEL_TIMEOUT_S:g} s "
              f"(load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
