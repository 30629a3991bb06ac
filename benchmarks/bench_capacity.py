"""How many students one machine holds: a class server's capacity, measured.

Each student is a process of its own (a kernel, as JupyterHub would start
one), with a 2-rank lab, running notebook 01's kind of cells in a loop: a
send/recv pair and an all_reduce, then a pause while the student reads (the
``--think`` seconds; 0 means flat out, the worst case). Students are added one
at a time. After each, a probe lab of this process measures the median round
trip of an empty ``lab.run``; the machine "holds" the largest number of
students for which that stays within 2x its idle value.

Memory per student is the proportional set size (PSS) of the student's whole
tree (kernel, controller, engine template, ranks): shared pages (torch's
libraries, mapped by every process) are split among the processes sharing
them, so the sum over students is what the machine actually gives them.

Goal: at most 400 MB per 2-rank student.
Run: ``.venv/bin/python benchmarks/bench_capacity.py [--max 8] [--think 1.0]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

import psutil

from ddplab import procs

STUDENT = textwrap.dedent("""
    import sys, time
    import ddplab

    def cell():
        import torch, torch.distributed as dist
        t = torch.arange(4.0)
        if dist.get_rank() == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        dist.all_reduce(t)
        return float(t.sum())

    lab = ddplab.start(world_size=2, backend="gloo", timeout=120)
    lab.run(cell)
    print("ready", flush=True)
    think = float(sys.argv[1])
    while True:
        lab.run(cell)
        time.sleep(think)
""")


def _nothing() -> None:
    return None


def round_trip_ms(lab, calls: int = 100) -> float:
    """Median wall time of an empty ``lab.run`` on both ranks, in ms."""
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        lab.run(_nothing)
        times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times)


def tree_pss_mb(pid: int) -> float:
    """PSS of process ``pid`` and all its descendants, in MB."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=8, help="students to add at most")
    parser.add_argument("--think", type=float, default=1.0,
                        help="seconds a student pauses between cells (0: flat out)")
    args = parser.parse_args()

    import ddplab
    probe = ddplab.start(world_size=2, backend="gloo", timeout=120)
    idle = round_trip_ms(probe)
    print(f"idle round trip: {idle:.2f} ms; load average {os.getloadavg()[0]:.1f}; "
          f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB")
    students: list[subprocess.Popen] = []
    held = 0
    try:
        for count in range(1, args.max + 1):
            student = subprocess.Popen([sys.executable, "-c", STUDENT, str(args.think)],
                                       stdout=subprocess.PIPE, text=True)
            students.append(student)
            # Its first lines are ddplab's own ("ddplab: 2 ranks ready, ..."): read to ours.
            if not any(line.strip() == "ready" for line in student.stdout):
                raise SystemExit(f"student {count} did not start (exit {student.wait()})")
            trip = round_trip_ms(probe)
            memory = [tree_pss_mb(s.pid) for s in students]
            print(f"{count} students: round trip {trip:.2f} ms ({trip / idle:.2f}x idle), "
                  f"memory per student {statistics.mean(memory):.0f} MB PSS "
                  f"(max {max(memory):.0f})", flush=True)
            if trip > 2 * idle:
                break
            held = count
    finally:
        for student in students:                 # each student's whole tree: kernel, lab
            procs.end_tree(student, grace=0)
            student.wait()
        probe.stop()
    print(f"holds {held} students (round trip within 2x idle; --think {args.think} s)")


if __name__ == "__main__":
    main()
