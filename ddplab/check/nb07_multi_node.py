"""Checkers for notebook 07 (multi-node numbering); see _core for the shared behaviour.

    ddplab.check.who_prints(who_prints)    # a prediction made in the kernel, no ranks involved
    ddplab.check.physical_gpu(physical_gpu)  # a function of the kernel's, called on rank 0

The expected answer comes from ``ddplab.hosts.rank_table``, which numbers the
ranks the way torchrun's static rendezvous does (``tests/test_check_multinode.py``
compares it with what a real two-node torchrun job's workers were told).
``who_prints``'s answer is the ranks themselves: its table shows what was
given for each guard, never the ranks that print. ``physical_gpu``'s shows
the function's results for the check's own cases.
"""

from __future__ import annotations

from typing import Any

from ._core import answers_of, checker, passed, spell_raised
from ._feedback import Feedback, Row

__all__ = ["physical_gpu", "who_prints"]

#: The job the exercise asks about.
NNODES, NPROC_PER_NODE = 2, 3

#: Each guard the exercise names, and what a wrong answer usually mixed up.
GUARDS = {
    "local_rank == 0": "local rank starts again at 0 on every node, so this guard is true once per node.",
    "rank == 0": "the global rank is unique in the whole job: exactly one process has rank 0.",
    "local_rank == local_world_size - 1": "the last process of each node; global rank = "
                                          "node_rank * nproc_per_node + local_rank.",
    "local_rank == 0 with --virtual-local-rank": "with --virtual-local-rank torchrun sets LOCAL_RANK=0 "
                                                 "in every worker (each sees its one GPU as cuda:0).",
}


def expected_printers(nnodes: int = NNODES, nproc_per_node: int = NPROC_PER_NODE) -> dict[str, list[int]]:
    """Global ranks whose guarded print runs, per guard, for a static-rendezvous torchrun job."""
    from ddplab.hosts import rank_table

    table = rank_table(nnodes, nproc_per_node)
    return {
        "local_rank == 0": [p.rank for p in table if p.local_rank == 0],
        "rank == 0": [p.rank for p in table if p.rank == 0],
        "local_rank == local_world_size - 1": [p.rank for p in table
                                               if p.local_rank == p.local_world_size - 1],
        "local_rank == 0 with --virtual-local-rank": [p.rank for p in table],
    }


@checker
def who_prints(answer: Any) -> None:
    """Check ``answer``: for each guard of ``GUARDS``, the sorted global ranks that print.

    The job is ``torchrun --nnodes 2 --nproc_per_node 3`` (static rendezvous).
    Ranks may be given in any order, as a list, tuple or set of ints.
    """
    __tracebackhide__ = True
    if not isinstance(answer, dict):
        raise Feedback(f"who_prints must be a dict from guard to a list of global ranks, got "
                       f"{type(answer).__name__}.", hint="keep the dict of the exercise cell.")
    missing = [g for g in GUARDS if g not in answer]
    if missing:
        raise Feedback(f"who_prints has no entry for {', '.join(map(repr, missing))}.",
                       hint="keep the keys of the exercise cell and fill in each list.")
    expected = expected_printers()
    rows = []
    for guard, why in GUARDS.items():
        got = answer[guard]
        ok = isinstance(got, (list, tuple, set)) and all(
            isinstance(r, int) and not isinstance(r, bool) for r in got)
        got_sorted = sorted(got) if ok else got
        if not ok or got_sorted != expected[guard] or len(set(got)) != len(got):
            rows.append(Row(f"if {guard}", repr(got_sorted), wrong=True, note=why))
    if rows:
        raise Feedback(f"who_prints is wrong for {len(rows)} of {len(GUARDS)} guards on {NNODES} "
                       f"nodes x {NPROC_PER_NODE} processes.", rows=rows,
                       hint="write out the job's rank table (node_rank, local_rank, rank of every "
                            "process) and read each guard off it.")
    passed(f"you know which of the {NNODES * NPROC_PER_NODE} processes print under each guard.")


# ----------------------------------------------------------------- physical_gpu
#: (device index, CUDA_VISIBLE_DEVICES, the physical GPU ``cuda:<index>`` is, or None: no such device).
#: None for the variable means unset: every GPU is visible, in its own order.
GPU_CASES = [
    (0, None, 0), (3, None, 3),
    (0, "2,3", 2), (1, "2,3", 3),
    (0, "1,0", 1), (1, "1,0", 0),          # the list's order is the numbering, not sorted
    (0, "6", 6),
    (2, "2,3", None), (0, "", None),       # past the visible list; an empty list hides every GPU
]

#: Workers of one node, as torchrun starts them: (LOCAL_RANK, CUDA_VISIBLE_DEVICES) per worker.
NODE_PLANS = {
    "torchrun --nproc_per_node 4, CUDA_VISIBLE_DEVICES=4,5,6,7": [(i, "4,5,6,7") for i in range(4)],
    "the same with --virtual-local-rank": [(0, str(4 + i)) for i in range(4)],
}


@checker(needs_lab=False)
def physical_gpu(fn: Any, lab: Any = None) -> None:
    """Check ``fn(index, cuda_visible_devices)``: the physical GPU that ``cuda:<index>`` names.

    ``cuda_visible_devices`` is the variable's value as a string, or None when it
    is unset; the answer is None when the process has no ``cuda:<index>``. ``fn``
    runs on rank 0 of the running lab (``answers_of``), or here if none runs.
    """
    __tracebackhide__ = True
    if not callable(fn):
        raise Feedback(f"physical_gpu must be a function (index, cuda_visible_devices), got "
                       f"{type(fn).__name__}.", hint="define it with def in the exercise cell.")
    plan_calls = [w for workers in NODE_PLANS.values() for w in workers]
    answers = answers_of(fn, [(index, visible) for index, visible, _ in GPU_CASES] + plan_calls, lab)
    rows = []
    for (index, visible, want), answer in zip(GPU_CASES, answers):
        got: Any = answer[1] if answer[0] == "ok" else spell_raised(answer)
        if got != want or isinstance(got, bool):
            rows.append(Row(f"physical_gpu({index}, {visible!r})", repr(got), repr(want), True))
    if rows:
        raise Feedback(f"physical_gpu is wrong in {len(rows)} of {len(GPU_CASES)} cases.", rows=rows,
                       hint="a process numbers the GPUs it sees from 0, in the order "
                            "CUDA_VISIBLE_DEVICES lists them (unset: every GPU, in its own order); "
                            "an index it does not see names no GPU: None.")
    used = iter(a[1] if a[0] == "ok" else spell_raised(a) for a in answers[len(GPU_CASES):])
    plans = "; ".join(f"{name}: workers use GPUs {[next(used) for _ in workers]}"
                      for name, workers in NODE_PLANS.items())
    passed(f"cuda:i is the i-th GPU CUDA_VISIBLE_DEVICES lists. {plans}.")
