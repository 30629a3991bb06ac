"""Checkers for notebook 07 (multi-node numbering); see _core for the shared behaviour.

    ddplab.check.who_prints(who_prints)    # a prediction made in the kernel, no ranks involved

The expected answer comes from ``ddplab.hosts.rank_table``, which numbers the
ranks the way torchrun's static rendezvous does (``tests/test_check_multinode.py``
compares it with what a real two-node torchrun job's workers were told).
"""

from __future__ import annotations

from typing import Any

from ._core import passed

__all__ = ["who_prints"]

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


def who_prints(answer: Any) -> None:
    """Check ``answer``: for each guard of ``GUARDS``, the sorted global ranks that print.

    The job is ``torchrun --nnodes 2 --nproc_per_node 3`` (static rendezvous).
    Ranks may be given in any order, as a list, tuple or set of ints.
    """
    __tracebackhide__ = True
    if not isinstance(answer, dict):
        raise AssertionError(f"who_prints must be a dict from guard to a list of global ranks, "
                             f"got {type(answer).__name__}. Keep the dict of the exercise cell.")
    missing = [g for g in GUARDS if g not in answer]
    if missing:
        raise AssertionError(f"who_prints has no entry for {', '.join(map(repr, missing))}. "
                             f"Keep the keys of the exercise cell and fill in each list.")
    expected = expected_printers()
    lines = []
    for guard, hint in GUARDS.items():
        got = answer[guard]
        ok = isinstance(got, (list, tuple, set)) and all(
            isinstance(r, int) and not isinstance(r, bool) for r in got)
        got_sorted = sorted(got) if ok else got
        if not ok or got_sorted != expected[guard] or len(set(got)) != len(got):
            lines.append(f"  if {guard}:\n      expected ranks {expected[guard]}\n"
                         f"      got            {got_sorted!r}   <-- wrong\n      Hint: {hint}")
    if lines:
        raise AssertionError(f"who_prints is wrong for {len(lines)} of {len(GUARDS)} guards on "
                             f"{NNODES} nodes x {NPROC_PER_NODE} processes:\n" + "\n".join(lines))
    passed(f"you know which of the {NNODES * NPROC_PER_NODE} processes print under each guard.")
