"""Checkers for notebook 02b, gather and scatter: ``max_and_rank``, ``parity_sum``,
``rows_to_columns``, and ``straggler``, read off a timeline.

    ddplab.check.max_and_rank()     # the student's %%ranks functions, on inputs drawn here
    ddplab.check.straggler(2)       # "rank 2 is the one the others waited for"

See ``_named`` for how a function is found and called on each rank, and
``_timeline`` for the checkers whose answer is read off a trace.
"""

from __future__ import annotations

from typing import Any

from . import _named as named
from ._core import checker, compare, passed
from ._feedback import Feedback
from ._timeline import traced

__all__ = ["max_and_rank", "parity_sum", "rows_to_columns", "straggler"]


# --------------------------------------------------------------- max_and_rank
@checker
def max_and_rank(lab: Any = None, timeout: float = named.CHECK_TIMEOUT) -> None:
    """Check ``max_and_rank(value)``: every rank gets ``(largest value, rank that holds it)``.

    ``value`` is a Python float, one per rank. When several ranks hold the
    largest value, the answer names the smallest of those ranks.
    """
    n = lab.world_size
    trials = []
    for _ in range(2):
        values = [float(v) / 4 for v in named.integers(named.draw(), 0, (n,)).tolist()]
        trials.append(values)
    # All negative (a running max that starts at 0 shows up), and the largest held
    # by two ranks: the answer must name the smaller one.
    tied = [-abs(v) - 1 for v in trials[0]]
    tied[-1] = tied[min(1, n - 1)] = max(tied) + 0.5
    trials.append(tied)
    for values in trials:
        got = named.answers("max_and_rank", values, lab, timeout)
        best = max(values)
        expected = [(best, values.index(best))] * n
        answers = []
        for answer, _ in got:
            if isinstance(answer, (list, tuple)) and len(answer) == 2:
                v, r = named.plain(answer[0]), named.plain(answer[1])
                r = int(r) if isinstance(r, float) and r.is_integer() else r
                answer = (v, r)
            answers.append(answer)
        compare(f"max_and_rank(value) with value = {named.said(values)}", expected, answers,
                atol=1e-6,
                hint="a MAX all_reduce finds the largest value but forgets who held it: "
                     "all_gather every rank's value (or (value, rank) with all_gather_object), "
                     "then pick the largest; on a tie, the smallest rank.")
    passed("every rank knows the largest value and which rank holds it.")


# ----------------------------------------------------------------- parity_sum
@checker
def parity_sum(lab: Any = None, timeout: float = named.CHECK_TIMEOUT) -> None:
    """Check ``parity_sum(x)``: each rank gets the sum of ``x`` over the ranks of its own parity.

    Even ranks get the sum over ranks 0, 2, ...; odd ranks over 1, 3, ....
    ``x`` must stay as it was.
    """
    import torch

    n = lab.world_size
    for shape in ((3,), (2,)):
        generator = named.draw()
        inputs = [named.integers(generator, rank, shape) for rank in range(n)]
        got = named.answers("parity_sum", inputs, lab, timeout)
        expected = [torch.stack(inputs[rank % 2::2]).sum(0) for rank in range(n)]
        compare(f"parity_sum(x) with x = {named.said(inputs)}", expected,
                [answer for answer, _ in got],
                hint="make both groups on every rank, dist.new_group(list(range(0, world_size, 2))) "
                     "and dist.new_group(list(range(1, world_size, 2))), then all_reduce a copy "
                     "of x with group= the one this rank belongs to.")
        compare("x after parity_sum(x)", inputs, [x for _, x in got],
                hint="all_reduce works in place: give it x.clone().")
    passed("each rank holds the sum over the ranks of its own parity.")


# ------------------------------------------------------------ rows_to_columns
@checker
def rows_to_columns(lab: Any = None, timeout: float = named.CHECK_TIMEOUT) -> None:
    """Check ``rows_to_columns(block)``: from a block of rows to a block of columns.

    A matrix ``M`` is split by rows: rank ``r`` holds ``block``, its ``k``
    consecutive rows (``M = torch.cat(blocks of ranks 0..n-1)``). It must
    return its block of columns: ``M.chunk(world_size, dim=1)[r]``.
    """
    import torch

    n = lab.world_size
    for k, width in ((1, 1), (2, 2), (2, 1)):
        # distinct values, so that a piece in the wrong place shows
        matrix = torch.randperm(n * k * n * width, generator=named.draw()).float().reshape(n * k, n * width)
        inputs = [block.clone() for block in matrix.chunk(n, dim=0)]
        got = named.answers("rows_to_columns", inputs, lab, timeout)
        expected = [column.clone() for column in matrix.chunk(n, dim=1)]
        compare(f"rows_to_columns(block) with block shape {list(inputs[0].shape)}", expected,
                [answer for answer, _ in got],
                hint="cut block into world_size pieces along dim=1 (piece j goes to rank j), "
                     "all_to_all them, and torch.cat what arrives along dim=0, in rank order.")
    passed("every rank turned its block of rows into its block of columns.")


# ------------------------------------------------------------------ straggler
@checker(reads_trace=True)
def straggler(answer: Any, trace: Any = None) -> None:
    """Which rank did the others wait for in the collectives? ``answer``: a rank number."""
    __tracebackhide__ = True
    trace = traced(trace, "straggler")
    truth = trace.straggler()
    if truth is None:
        raise Feedback("in this trace no rank waited for another in a collective, so there is no "
                       "straggler to find.", hint="re-run the traced cell above.")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise Feedback(f"answer with a rank number, e.g. ddplab.check.straggler(0); got {answer!r}.")
    if answer != truth:
        raise Feedback(f"rank {answer} is not the straggler: {_not_straggler(trace, answer)}",
                       hint="the straggler is the rank whose collective box has no hatching; "
                            "everyone else's box is hatched while they wait for it to arrive.")
    passed(f"rank {truth} arrived last, and every other rank waited for it in the collective.")


def _not_straggler(trace: Any, rank: int) -> str:
    """Why ``rank`` is not the straggler, without naming the one that is."""
    if rank not in trace.ranks:
        return f"the trace has ranks {', '.join(map(str, trace.ranks))}, and no rank {rank}."
    instances = [i for i in trace.collectives() if len(i) > 1]
    waited = any(e.waited > 0 for i in instances for e in i if e.rank == rank)
    last = any(max(i, key=lambda e: e.start).rank == rank for i in instances)
    if waited and not last:
        return (f"rank {rank} itself waited in the collective for another rank (its box is "
                f"hatched), so it was not the one the others waited for.")
    if not last:
        return f"rank {rank} never arrived last at a collective, so nobody waited for it."
    return (f"the others did wait for rank {rank} in a collective, but in all they waited longer "
            f"for another rank.")
