"""The planner against this machine: predicted vs measured step time and memory, and a 1B plan's cost.

Side by side in one run:

1. α and β from a 2-rank lab (``ddplab.bench``: gloo's all_reduce at 64 KB..16 MB,
   ``fit_ring``), as a learner fits them on their lab;
2. ``ddplab.plan`` of the toy MLP (``CONFIGS["toy"]``) for ddp and fsdp at 2 and 4
   ranks with that fit and ``device="this-cpu"`` (a matmul's FLOP/s here, shared by
   the ranks that share the cores);
3. the same model trained on 2- and 4-rank labs (DDP, FSDP2's ``fully_shard``): the
   median step time (slowest rank) and ``ddplab.memory.breakdown`` per rank.
   Goals: step time at 4 ranks within 25 %, memory within 10 %;
4. ``python -m ddplab.plan llm-1b`` at 8, 64 and 1024 ranks: wall time (goal < 60 s),
   CPU time, and the peak RSS of its processes (goal < 4 GB).

Run: ``.venv/bin/python benchmarks/bench_plan.py [--steps 8]``; ``--only-1b 3``: the 1B plan
alone, three times. On a shared machine
the wall times measure the neighbours too; the CPU times less so.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import ddplab
from ddplab import bench, procs
from ddplab.plan import CONFIGS

TOY = CONFIGS["toy"]             # --model picks another


def _train_on_rank(config: dict, strategy: str, steps: int) -> dict:
    """On a rank: the best and the median step time over ``steps`` (each the slowest rank's),
    and the memory."""
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
    # after a step: gradients and state exist. ddplab.memory.saved_bytes cannot read FSDP2's
    # parameters (DTensors whose storage is freed between uses): its state only, by sharding.memory
    held = breakdown(model, optimizer, x) if strategy == "ddp" else memory(model, optimizer)
    # the best step, as ddplab.bench keeps the best repetition (the others measure the neighbours
    # on a shared machine); the median beside it
    return {"step": min(times), "median": statistics.median(times), "memory": held}


def measured(world_size: int, steps: int) -> dict:
    out = {}
    with ddplab.start(world_size=world_size, backend="gloo", timeout=600) as lab:
        for strategy in ("ddp", "fsdp"):
            out[strategy] = lab.run(_train_on_rank, TOY.to_dict(), strategy, steps, timeout=900)[0]
    return out


def one_b_plan() -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = procs.run_command([sys.executable, "-m", "ddplab.plan", "llm-1b", "--world-sizes", "8", "64",
                              "1024"], timeout=900, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(done.stderr)
    return {"wall": wall, "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "rss_gb": after.ru_maxrss / 1e6, "table": done.stdout}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="toy", choices=["toy", "toy-wide"],
                        help="toy-wide: 2.25x the FLOPs per parameter row, so fixed costs weigh less")
    parser.add_argument("--skip-1b", action="store_true", help="leave out the 1B plan")
    parser.add_argument("--only-1b", type=int, metavar="N", default=0,
                        help="time only the 1B plan, N times (no labs)")
    args = parser.parse_args()
    if args.only_1b:
        for _ in range(args.only_1b):
            load = os.getloadavg()[0]
            plan = one_b_plan()
            print(f"1B plan at 8/64/1024 ranks: {plan['wall']:.1f} s wall, {plan['cpu']:.1f} s CPU, "
                  f"peak RSS {plan['rss_gb']:.2f} GB (load {load:.1f} -> {os.getloadavg()[0]:.1f})",
                  flush=True)
        return 0
    global TOY
    TOY = CONFIGS[args.model]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with ddplab.start(world_size=2, backend="gloo", timeout=600) as lab:
        results = bench.measure(lab, "all_reduce", "dist.all_reduce", None, ["64K", "1M", "4M", "16M"], 5)
    fit = bench.fit_ring(results, name="dist.all_reduce")
    print(f"2-rank fit: alpha {fit['alpha'] * 1e6:.1f} us, beta {fit['beta'] * 1e9:.3f} ns/B "
          f"({1 / fit['beta'] / 1e9:.2f} GB/s)", flush=True)
    print("\nstep time (s)            predicted  measured  ratio   [compute / comm exposed]  median  ratio")
    for n in (2, 4):
        real = {n: measured(n, args.steps)}
        made = ddplab.plan(TOY, [n], ["ddp", "fsdp"], device="this-cpu", network=fit)   # just after
        for strategy in ("ddp", "fsdp"):
            s = made.row(strategy, n).step
            got, median = real[n][strategy]["step"], real[n][strategy]["median"]
            print(f"  {strategy:<5} at {n} ranks      {s.total:9.4f} {got:9.4f} {s.total / got:6.2f}   "
                  f"[{s.compute:.4f} / {s.exposed:.4f}]  {median:7.4f} {s.total / median:6.2f}")
        for strategy in ("ddp", "fsdp"):
            row, got = made.row(strategy, n), real[n][strategy]["memory"]
            kinds = ("parameters", "gradients", "optimizer") + (("activations",) if strategy == "ddp" else ())
            want, have = sum(row.memory[k] for k in kinds), sum(got[k] for k in kinds)
            print(f"  memory {strategy:<5} at {n} ranks ({'+'.join(k[:5] for k in kinds)}): predicted "
                  f"{want / 1e6:.2f} MB, ddplab.memory {have / 1e6:.2f} MB, ratio {want / have:.3f}; "
                  f"peak (tracker) {row.peak / 1e6:.2f} MB")
    if not args.skip_1b:
        plan = one_b_plan()
        print(plan["table"])
        print(f"1B plan at 8/64/1024 ranks: {plan['wall']:.1f} s wall, {plan['cpu']:.1f} s CPU, "
              f"peak RSS {plan['rss_gb']:.2f} GB (goals: < 60 s, < 4 GB)")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
