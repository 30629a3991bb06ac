"""The planner against published runs, against this machine, and its own speed.

    .venv/bin/python benchmarks/bench_plan.py --published        # the comparison table of docs/plan.md
    .venv/bin/python benchmarks/bench_plan.py --speed 3 --before /tmp/planner_before
    .venv/bin/python benchmarks/bench_plan.py --lab              # toy MLP: planned vs trained here

``--published``: every run of ``ddplab.plan.published.RUNS`` planned as its authors ran
it (model, batch, precision, checkpointing, strategy, GPUs; ``device="h100"``, the
"nvlink+ib" network), memory per GPU held against what they published, and tokens per
second per GPU after fitting the efficiency on one run only (``published.CALIBRATION``,
torchtitan's Table 1 FSDP row): every other throughput is a prediction. Goals: memory
within 15 % where the planner can express the run, throughput within 25 %.

``--speed N``: ``python -m ddplab.plan llm-8b --world-sizes 8 64 1024`` N times (goal:
under 60 s and 4 GB), wall time, CPU time of it and its children, and peak RSS, with the
load average beside each figure; with ``--before DIR`` (a copy of an older ddplab, e.g.
``git archive e1f4d17 ddplab | tar -x -C DIR``) the old planner alternating with this one,
so each pair sees the same neighbours.

``--lab``: α and β fitted on a 2-rank lab, the toy MLP planned with them on
``device="this-cpu"`` and trained for real on 2 and 4 ranks (step time and memory).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import ddplab
from ddplab import procs
from ddplab.plan import published


def one_plan(python_path: str | None = None) -> dict:
    """``python -m ddplab.plan llm-8b --world-sizes 8 64 1024``: wall, CPU (it and its children),
    peak RSS, with the ddplab at ``python_path`` (default: this one)."""
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = python_path
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = procs.run_command([sys.executable, "-m", "ddplab.plan", "llm-8b", "--world-sizes", "8", "64",
                              "1024"], timeout=1800, capture_output=True, text=True, env=env,
                             cwd=python_path or None)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(done.stderr)
    return {"wall": wall, "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "rss_gb": after.ru_maxrss / 1e6, "table": done.stdout, "load": (load, os.getloadavg()[0])}


def speed(times: int, before: str | None) -> None:
    for i in range(times):
        versions = [("before", before), ("after", None)] if before else [("after", None)]
        for name, path in versions:
            got = one_plan(path)
            print(f"run {i + 1} {name:>6}: {got['wall']:5.1f} s wall, {got['cpu']:5.1f} s CPU, peak RSS "
                  f"{got['rss_gb']:.2f} GB (load {got['load'][0]:.1f} -> {got['load'][1]:.1f})", flush=True)
    print(got["table"])


def _train_on_rank(config: dict, strategy: str, steps: int) -> dict:
    """On a rank: the best and the median step time over ``steps`` (each the slowest rank's)."""
    import warnings

    import torch
    import torch.distributed as dist

    from ddplab.memory import breakdown
    from ddplab.plan.models import Config
    from ddplab.sharding import memory

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")   # our blocks return no views
    c = Config(**config)
    torch.manual_seed(0)
    model = c.build()
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = c.batch_for()

    def one() -> None:
        model(x).float().sum().backward()
        optimizer.step()

    one()
    optimizer.zero_grad()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        one()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
        if len(times) < steps:
            optimizer.zero_grad()
    held = breakdown(model, optimizer, x) if strategy == "ddp" else memory(model, optimizer)
    return {"step": min(times), "median": statistics.median(times), "memory": held}


def lab(steps: int) -> None:
    from ddplab import bench
    from ddplab.plan import CONFIGS

    toy = CONFIGS["toy"]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with ddplab.start(world_size=2, backend="gloo", timeout=600) as two:
        results = bench.measure(two, "all_reduce", "dist.all_reduce", None, ["64K", "1M", "4M", "16M"], 5)
    fit = bench.fit_ring(results, name="dist.all_reduce")
    print(f"2-rank fit: alpha {fit['alpha'] * 1e6:.1f} us, beta {fit['beta'] * 1e9:.3f} ns/B", flush=True)
    for n in (2, 4):
        with ddplab.start(world_size=n, backend="gloo", timeout=600) as ranks:
            real = {s: ranks.run(_train_on_rank, toy.to_dict(), s, steps, timeout=900)[0]
                    for s in ("ddp", "fsdp")}
        made = ddplab.plan(toy, [n], ["ddp", "fsdp"], device="this-cpu", network=fit)
        for strategy in ("ddp", "fsdp"):
            s, got = made.row(strategy, n).step, real[strategy]
            kinds = ("parameters", "gradients", "optimizer")
            want = sum(made.row(strategy, n).memory[k] for k in kinds)
            have = sum(got["memory"][k] for k in kinds)
            print(f"  {strategy:<5} at {n} ranks: step predicted {s.total:.4f} s, best {got['step']:.4f}, "
                  f"median {got['median']:.4f} (ratio {s.total / got['median']:.2f}); "
                  f"state {want / 1e6:.2f} MB "
                  f"planned, {have / 1e6:.2f} MB on the ranks (ratio {want / have:.3f})", flush=True)
    print(f"load average at end: {os.getloadavg()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", action="store_true", help="the comparison with published runs")
    parser.add_argument("--speed", type=int, metavar="N", default=0, help="time the 8B plan N times")
    parser.add_argument("--before", metavar="DIR", help="with --speed: an older ddplab to time beside")
    parser.add_argument("--lab", action="store_true", help="the toy MLP planned and trained here")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if not (args.published or args.speed or args.lab):
        parser.error("say what to run: --published, --speed N or --lab")
    if args.published:
        print(f"load average at start: {os.getloadavg()}", flush=True)
        compared = published.compare(say=lambda line: print(line, flush=True))
        print(published.markdown(compared))
        print(f"load average at end: {os.getloadavg()}")
    if args.speed:
        speed(args.speed, args.before)
    if args.lab:
        lab(args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
