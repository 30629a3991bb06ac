"""Start-up and round-trip cost of a lab, measured side by side against the references.

1. Wall time of ``ddplab.start(world_size=4)`` plus a barrier, against
   ``torchrun --standalone --nproc_per_node=4`` running a script that imports
   torch and joins a gloo group. Goal: ratio <= 0.5. "Cold" is the first lab of
   a fresh kernel (its engine template imports torch once); "warm" is a later
   lab of the same kernel (the template is already warm).
2. ``lab.restart()`` plus a barrier. Goal: under 1 s.
3. Round trip of an empty ``lab.run`` on 4 ranks, against a raw ipyparallel
   ``apply_sync`` on the same engines. Goal: ratio <= 1.2.

Each side runs ``--repeat`` times, alternating, and we compare medians.
Run: ``.venv/bin/python benchmarks/bench_start.py [--repeat 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def _barrier() -> None:
    import torch.distributed as dist
    dist.barrier()


def _nothing() -> None:
    return None


def time_lab_start(world_size: int) -> float:
    import ddplab
    begin = time.perf_counter()
    lab = ddplab.start(world_size=world_size, backend="gloo")
    lab.run(_barrier)
    elapsed = time.perf_counter() - begin
    lab.stop()
    return elapsed


COLD_START = """
import time, ddplab, torch.distributed as dist
begin = time.perf_counter()
lab = ddplab.start(world_size={n}, backend="gloo")
lab.run(dist.barrier)
print(time.perf_counter() - begin)
lab.stop()
"""


def time_cold_lab_start(world_size: int) -> float:
    """The first lab of a fresh kernel process (``import ddplab`` done, as after a notebook's first cell)."""
    out = subprocess.run([sys.executable, "-c", COLD_START.format(n=world_size)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def time_restarts(world_size: int, repeat: int) -> list[float]:
    import ddplab
    times = []
    with ddplab.start(world_size=world_size, backend="gloo") as lab:
        for _ in range(repeat):
            begin = time.perf_counter()
            lab.restart()
            lab.run(_barrier)
            times.append(time.perf_counter() - begin)
    return times


def time_torchrun(world_size: int, script: Path) -> float:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, LOGLEVEL="ERROR")
    begin = time.perf_counter()
    subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={world_size}", str(script)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - begin


def round_trips(world_size: int, calls: int) -> tuple[float, float]:
    """Median seconds per empty call: (ddplab lab.run, raw ipyparallel apply_sync)."""
    import ddplab
    with ddplab.start(world_size=world_size, backend="gloo") as lab:
        view = lab.engines.engine_set.view(tuple(lab.ranks))
        for _ in range(5):                      # warm up both paths
            lab.run(_nothing)
            view.apply_sync(_nothing)
        ours, raw = [], []
        for _ in range(calls):
            begin = time.perf_counter()
            lab.run(_nothing)
            ours.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            view.apply_sync(_nothing)
            raw.append(time.perf_counter() - begin)
    return statistics.median(ours), statistics.median(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    n = args.world_size

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "join_gloo.py"
        script.write_text(TORCHRUN_SCRIPT)
        colds, warms, torchruns = [], [], []
        for _ in range(args.repeat):
            torchruns.append(time_torchrun(n, script))
            colds.append(time_cold_lab_start(n))
            warms.append(time_lab_start(n))
    cold_s, warm_s = statistics.median(colds), statistics.median(warms)
    torchrun_s = statistics.median(torchruns)
    restarts = time_restarts(n, max(args.repeat, 5))
    ours, raw = round_trips(n, args.calls)

    def runs(times):
        return ", ".join(f"{t:.2f}" for t in times)

    print(f"start, {n} ranks + barrier (median of {args.repeat})")
    print(f"  ddplab.start, cold {cold_s:6.2f} s   runs: {runs(colds)}")
    print(f"  ddplab.start, warm {warm_s:6.2f} s   runs: {runs(warms)}")
    print(f"  torchrun           {torchrun_s:6.2f} s   runs: {runs(torchruns)}")
    print(f"  ratio, cold        {cold_s / torchrun_s:6.2f}x  (goal <= 0.5)")
    print(f"  ratio, warm        {warm_s / torchrun_s:6.2f}x  (goal <= 0.5)")
    print(f"lab.restart() + barrier, {n} ranks (median of {len(restarts)})")
    print(f"  restart            {statistics.median(restarts):6.2f} s   runs: {runs(restarts)}"
          "  (goal < 1 s)")
    print(f"round trip, empty call on {n} ranks (median of {args.calls})")
    print(f"  lab.run           {ours * 1e3:6.2f} ms")
    print(f"  raw apply_sync    {raw * 1e3:6.2f} ms")
    print(f"  ratio             {ours / raw:6.2f}x  (goal <= 1.2)")


if __name__ == "__main__":
    main()
