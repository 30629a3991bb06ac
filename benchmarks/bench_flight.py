"""What torch's flight recorder costs a DDP training step when nothing hangs.

Every lab turns the recorder on (``ddplab.rank.flight``: ``TORCH_FR_BUFFER_SIZE``
before the group is made) so that a ``HangError`` can say which collective
each rank is in. It records one entry per collective. This measures a DDP
step (forward, backward with DDP's bucketed all_reduces, optimizer step) of a
small MLP on 2 gloo ranks, with the recorder off (``TORCH_FR_BUFFER_SIZE=0``)
and on, in labs that alternate, each "on" run compared with the mean of the
"off" runs either side of it (a shared machine's load drifts).

Goal (issue 29): under 2 % slower.

Run: ``.venv/bin/python benchmarks/bench_flight.py [--repeat 5] [--steps 300]``
"""

from __future__ import annotations

import argparse
import os
import statistics

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
