"""What torch's flight recorder costs a DDP training step when nothing hangs.

Every lab turns the recorder on (``ddplab.rank.flight``: ``TORCH_FR_BUFFER_SIZE``
before the group is made) so that a ``HangError`` can say which collective
each rank is in. It records one entry per collective. This measures a DDP
step (forward, backward with DDP's bucketed all_reduces, optimizer step) of a
small MLP on 2 gloo ranks, with the recorder off (``TORCH_FR_BUFFER_SIZE=0``)
and on, in labs that alternate, each "on" run compared with the mean of the
"off" runs either side of it (a shared machine's load drifts).

Goal (issue 29): under 2 % slower.

On a shared 2-core machine two labs' DDP steps differ by more than 2 % from
run to run, so ``--per-call`` also measures the recorder where the noise is
smaller: the calling thread's CPU time per ``all_reduce`` of one float on a
1-rank gloo group in a fresh process, 40 Python frames deep (a rank's stack
under ipykernel is about that deep, and the recorder keeps each call's stack),
recorder off and on alternately. That cost, times the collectives of a step,
over a step's CPU time, bounds the recorder's share of a DDP step.

Run: ``.venv/bin/python benchmarks/bench_flight.py [--repeat 5] [--steps 300] [--per-call]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import ddplab


def ddp_steps(steps: int) -> tuple[float, float]:
    """On a rank: (wall, main-thread CPU) seconds per DDP step of a small MLP, over ``steps``."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(20):                                  # warm up
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    began, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - began) / steps, (time.thread_time() - cpu) / steps


def recorder_entries() -> int:
    """On a rank: how many entries the flight recorder holds (0 when it is off)."""
    from ddplab.rank import flight
    return len(flight.summary())


def one_run(recorder: bool, steps: int) -> tuple[float, float]:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000" if recorder else "0"
    with ddplab.start(world_size=2, backend="gloo", timeout=900) as lab:
        timed = lab.run(ddp_steps, steps)
        per_step = (max(w for w, _ in timed), max(c for _, c in timed))
        entries = lab.run(recorder_entries)
        assert (min(entries) > 0) == recorder, f"recorder {'on' if recorder else 'off'}: {entries}"
    return per_step


# One process, one rank: the calling thread's CPU microseconds per all_reduce, `depth` frames deep.
PER_CALL = """
import sys, tempfile, time
import torch, torch.distributed as dist
calls, depth = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
t = torch.ones(1)
def timed(k):
    if k:
        return timed(k - 1)
    for _ in range(2000):
        dist.all_reduce(t)
    began = time.thread_time()
    for _ in range(calls):
        dist.all_reduce(t)
    return (time.thread_time() - began) / calls
print(timed(depth) * 1e6)
dist.destroy_process_group()
"""


def per_call(recorder: bool, calls: int = 20000, depth: int = 40) -> float:
    """CPU microseconds per all_reduce of one float, recorder off or on, in a fresh process."""
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000" if recorder else "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PER_CALL, str(calls), str(depth)], env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-call", action="store_true",
                        help="also the recorder's CPU cost per collective, in one process")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    off = [one_run(False, args.steps)]
    on = []
    for _ in range(args.repeat):
        on.append(one_run(True, args.steps))
        off.append(one_run(False, args.steps))
    print(f"DDP step, 2 ranks, {args.steps} steps a run, {args.repeat} paired runs")
    for i, what in enumerate(("wall", "main-thread CPU")):
        paired = [on[k][i] / ((off[k][i] + off[k + 1][i]) / 2) for k in range(len(on))]
        print(f"  {what}: off {statistics.median(o[i] for o in off) * 1e3:.3f} ms, "
              f"on {statistics.median(o[i] for o in on) * 1e3:.3f} ms per step (medians); "
              f"on / off paired: median {statistics.median(paired):.3f} "
              f"(runs: {', '.join(f'{p:.3f}' for p in paired)}); goal < 1.02")
    if args.per_call:
        off_us, on_us = [], []
        for _ in range(args.repeat):
            off_us.append(per_call(False))
            on_us.append(per_call(True))
        cost = statistics.median(on_us) - statistics.median(off_us)
        step_cpu_us = statistics.median(o[1] for o in off) * 1e6
        print(f"  per all_reduce, 40 frames deep, calling thread's CPU: off {statistics.median(off_us):.2f} "
              f"us, on {statistics.median(on_us):.2f} us (medians of {args.repeat}): the recorder adds "
              f"{cost:.2f} us a collective, {cost / step_cpu_us:.2%} of a DDP step's "
              f"{step_cpu_us:.0f} us of CPU (one all_reduce a step: the MLP's 85k parameters fit "
              f"DDP's first bucket); goal < 2 %")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
