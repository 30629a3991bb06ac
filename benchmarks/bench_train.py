"""Training throughput of ``ddplab.train.train`` through the lab against torchrun, and its scaling.

The same function, the same config, the same threads per process, side by
side in one run: for each world size (1, 2 and 4 ranks by default), the lab
runs it with ``lab.run`` (live progress reporting included) and torchrun runs
it as ``torchrun --nproc-per-node N -m ddplab.train``, alternating, ``--repeat``
times each. Throughput is what ``train`` measures itself: training samples
per second over all ranks, the training steps only (not start-up, not
evaluation). We compare medians. Goal: lab / torchrun >= 0.95.

Run: ``.venv/bin/python benchmarks/bench_train.py [--repeat 3] [--epochs 4] [--ranks 1 2 4]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

from ddplab import train
from ddplab.env import omp_threads
from ddplab.lab import Lab, LabSpec


def lab_run(lab: Lab, config: train.Config) -> float:
    # The progress board's text lines (outside Jupyter) would bury the table;
    # the ranks still publish their progress, so its cost is measured.
    with contextlib.redirect_stdout(io.StringIO()):
        results = lab.run(train.train, config, timeout=900)
    return statistics.median(r["samples_per_s"] for r in results)


def torchrun_run(ranks: int, config: train.Config, threads: int | None = None) -> float:
    # The result file holds rank 0's figure; every rank measures the same steps.
    return train.torchrun(config, nproc_per_node=ranks, timeout=900,
                          threads=threads)["samples_per_s"]


def measure(ranks: int, config: train.Config, repeat: int) -> dict:
    lab = Lab(LabSpec(world_size=ranks, backend="gloo", timeout=900, grace=2.0,
                      pg_timeout=1800, debug=False), gpus=0)
    lab.start()
    try:
        lab_run(lab, train.Config(epochs=1, verbose=False))      # warm up: imports, data, DDP
        ours, theirs, one_thread = [], [], []
        for _ in range(repeat):
            ours.append(lab_run(lab, config))
            theirs.append(torchrun_run(ranks, config))
            if omp_threads(ranks) > 1:       # is a second thread per rank worth it?
                one_thread.append(torchrun_run(ranks, config, threads=1))
    finally:
        lab.stop()
    return {"ranks": ranks, "threads": omp_threads(ranks), "lab": statistics.median(ours),
            "torchrun": statistics.median(theirs), "lab_all": ours, "torchrun_all": theirs,
            "one_thread": statistics.median(one_thread) if one_thread else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    # Both sides on the CPU, also on a GPU machine: the lab's ranks are gloo on CPU, and
    # torchrun's workers would otherwise take the GPU (on an H200 they trained this small
    # model 3.6x slower than the lab's CPU ranks: not the lab's overhead, the device).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    config = train.Config(epochs=args.epochs, verbose=False)
    print(f"ddplab.train.train, {args.epochs} epochs of the digits (1437 samples), batch "
          f"{config.batch_size} per rank, gloo on CPU; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f} at the start; median of {args.repeat}.",
          flush=True)
    rows = []
    for ranks in args.ranks:
        begin = time.perf_counter()
        rows.append(measure(ranks, config, args.repeat))
        print(f"  measured {ranks} rank(s) in {time.perf_counter() - begin:.0f} s", flush=True)
    base_lab, base_torchrun = rows[0]["lab"], rows[0]["torchrun"]
    print()
    print(f"{'ranks':>5} {'threads/rank':>12} {'lab samples/s':>14} {'torchrun samples/s':>19} "
          f"{'lab/torchrun':>13} {'lab speed-up':>13} {'torchrun speed-up':>18}")
    for row in rows:
        print(f"{row['ranks']:>5} {row['threads']:>12} {row['lab']:>14.0f} {row['torchrun']:>19.0f} "
              f"{row['lab'] / row['torchrun']:>12.2f}x {row['lab'] / base_lab:>12.2f}x "
              f"{row['torchrun'] / base_torchrun:>17.2f}x")
    for row in rows:
        if row["one_thread"]:
            print(f"{row['ranks']:>5} {1:>12} {'':>14} {row['one_thread']:>19.0f}   "
                  f"(torchrun with 1 thread per rank, for comparison)")
    worst = min(row["lab"] / row["torchrun"] for row in rows)
    best = min(max(row["lab_all"]) / max(row["torchrun_all"]) for row in rows)
    print(f"\nworst lab/torchrun ratio of medians: {worst:.2f}, of best runs: {best:.2f} "
          f"(goal >= 0.95): {'met' if min(worst, best) >= 0.95 else 'NOT met'}. On a machine "
          f"shared with other work, single runs vary a lot; the best run is the least disturbed.")
    print(f"load average {os.getloadavg()[0]:.1f} at the end. All runs: "
          + "; ".join(f"{r['ranks']} ranks lab {[round(v) for v in r['lab_all']]} torchrun "
                      f"{[round(v) for v in r['torchrun_all']]}" for r in rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
