"""Checkers for notebook 02, collectives (all_reduce, all_gather, all_to_all, groups, ...).

Each exercise asks for a function written in a ``%%ranks`` cell, so it lives
on every rank and can use that rank's ``rank``, ``world_size`` and groups:

    %%ranks
    def global_mean(losses):
        ...

The check cell names no arguments, ``ddplab.check.global_mean()``: the
checker finds the function by name on each rank, calls it there with inputs
it drew itself from a seed no rank sees (distinct per rank and per trial, so
an answer that only fits the notebook's numbers fails), each rank sent only
its own (``Lab.run_each``), and computes the expected answer in the kernel
with single-process torch over every rank's input. A rank learns another
rank's input only by communicating, and what the student's code does on the
ranks cannot change that reference.

A function that raises fails the check with that rank's traceback; one that
deadlocks fails it with where each rank is stuck (the lab then needs
``lab.restart()``). Both come as ``AssertionError``, like a wrong answer.
"""

from __future__ import annotations

from typing import Any

from ._core import MISSING, compare, lab_or_current, passed, require_function, run_student_code

__all__ = ["global_mean", "max_and_rank", "parity_sum", "rows_to_columns"]

_CHECK_TIMEOUT = 60.0


def _call(name: str, arg: Any) -> Any:
    """On a rank: call the student's ``name`` on this rank's input ``arg``, sent to this rank alone.

    Returns ``[answer, the input as it is afterwards]``, or a marker when the
    rank has no such function (the exercise cell did not run, or failed).
    """
    from ddplab.rank.engine import namespace

    fn = namespace().get(name)
    if not callable(fn):
        return MISSING
    return [fn(arg), arg]


def _answers(name: str, inputs: list[Any], lab: Any, timeout: float) -> list[list[Any]]:
    """``_call`` on every rank, rank ``r`` sent only ``inputs[r]`` (``Lab.run_each``); results by rank.

    A missing function, an exception or a hang becomes an AssertionError.
    """
    got = run_student_code(f"{name}(...)", _call, name, lab=lab, timeout=timeout,
                           hint="every rank of a group must call the same collectives in the "
                                "same order.", each={rank: (x,) for rank, x in enumerate(inputs)})
    got = [got[rank] for rank in range(len(inputs))]
    require_function(got, name)
    return got


def _draw() -> Any:
    """A generator seeded now, from a seed no rank sees: each check's inputs are new."""
    import secrets

    import torch

    return torch.Generator().manual_seed(secrets.randbits(62))


def _integers(generator: Any, rank: int, shape: tuple[int, ...]) -> Any:
    """Small whole numbers as float32, distinct per draw and rank: sums and means stay exact."""
    import torch

    return torch.randint(-9, 10, shape, generator=generator).float() + 20 * rank


def _said(inputs: list[Any]) -> str:
    """Every rank's input, for the first line of a failure: ``[1.0, 2.0] on rank 0, ...``."""
    return ", ".join(f"{x.tolist() if hasattr(x, 'tolist') else x!r} on rank {rank}"
                     for rank, x in enumerate(inputs))


def _plain(value: Any) -> Any:
    """A one-element tensor as a Python number, so 3.0 and tensor(3.) compare equal."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        return value.item()
    return value


# ---------------------------------------------------------------- global_mean
def global_mean(lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``global_mean(losses)``: every rank gets the mean over *all samples* of all ranks.

    ``losses`` is a 1-D float tensor of per-sample values whose length differs
    from rank to rank (a short last batch; a rank with no sample at all). The
    answer is that one number (a Python float or a one-element tensor);
    ``losses`` must stay as it was. The reference is ``torch.cat(inputs).mean()``,
    which the mean of the ranks' means is not.
    """
    import torch

    lab = lab_or_current(lab)
    n = lab.world_size
    # Lengths that differ per rank, so that the mean of means is wrong; then one rank with none.
    for lengths in ([1 + 2 * r for r in range(n)], [3] * (n - 1) + [0]):
        generator = _draw()
        inputs = [_integers(generator, rank, (length,)) for rank, length in enumerate(lengths)]
        got = _answers("global_mean", inputs, lab, timeout)
        expected = torch.cat(inputs).mean().item()
        what = f"global_mean(losses) with losses = {_said(inputs)}"
        compare(what, [expected] * n, [_plain(answer) for answer, _ in got], atol=1e-4,
                hint="the mean of the ranks' means counts a short batch as much as a full one. "
                     "all_reduce two numbers, this rank's sum of losses and its number of samples "
                     "(one tensor, on a copy), then divide the total sum by the total count.")
        compare("losses after global_mean(losses)", inputs, [x for _, x in got],
                hint="all_reduce works in place: reduce a new tensor, so the caller's losses "
                     "keep this rank's own values.")
    passed("global_mean(losses) gives every rank the mean over all samples, and leaves losses alone.")


# --------------------------------------------------------------- max_and_rank
def max_and_rank(lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``max_and_rank(value)``: every rank gets ``(largest value, rank that holds it)``.

    ``value`` is a Python float, one per rank. When several ranks hold the
    largest value, the answer names the smallest of those ranks.
    """
    lab = lab_or_current(lab)
    n = lab.world_size
    trials = []
    for _ in range(2):
        values = [float(v) / 4 for v in _integers(_draw(), 0, (n,)).tolist()]
        trials.append(values)
    # All negative (a running max that starts at 0 shows up), and the largest held
    # by two ranks: the answer must name the smaller one.
    tied = [-abs(v) - 1 for v in trials[0]]
    tied[-1] = tied[min(1, n - 1)] = max(tied) + 0.5
    trials.append(tied)
    for values in trials:
        got = _answers("max_and_rank", values, lab, timeout)
        best = max(values)
        expected = [(best, values.index(best))] * n
        answers = []
        for answer, _ in got:
            if isinstance(answer, (list, tuple)) and len(answer) == 2:
                v, r = _plain(answer[0]), _plain(answer[1])
                r = int(r) if isinstance(r, float) and r.is_integer() else r
                answer = (v, r)
            answers.append(answer)
        compare(f"max_and_rank(value) with value = {_said(values)}", expected, answers,
                atol=1e-6,
                hint="a MAX all_reduce finds the largest value but forgets who held it: "
                     "all_gather every rank's value (or (value, rank) with all_gather_object), "
                     "then pick the largest; on a tie, the smallest rank.")
    passed("every rank knows the largest value and which rank holds it.")


# ----------------------------------------------------------------- parity_sum
def parity_sum(lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``parity_sum(x)``: each rank gets the sum of ``x`` over the ranks of its own parity.

    Even ranks get the sum over ranks 0, 2, ...; odd ranks over 1, 3, ....
    ``x`` must stay as it was.
    """
    import torch

    lab = lab_or_current(lab)
    n = lab.world_size
    for shape in ((3,), (2,)):
        generator = _draw()
        inputs = [_integers(generator, rank, shape) for rank in range(n)]
        got = _answers("parity_sum", inputs, lab, timeout)
        expected = [torch.stack(inputs[rank % 2::2]).sum(0) for rank in range(n)]
        compare(f"parity_sum(x) with x = {_said(inputs)}", expected,
                [answer for answer, _ in got],
                hint="make both groups on every rank, dist.new_group(list(range(0, world_size, 2))) "
                     "and dist.new_group(list(range(1, world_size, 2))), then all_reduce a copy "
                     "of x with group= the one this rank belongs to.")
        compare("x after parity_sum(x)", inputs, [x for _, x in got],
                hint="all_reduce works in place: give it x.clone().")
    passed("each rank holds the sum over the ranks of its own parity.")


# ------------------------------------------------------------ rows_to_columns
def rows_to_columns(lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``rows_to_columns(block)``: from a block of rows to a block of columns.

    A matrix ``M`` is split by rows: rank ``r`` holds ``block``, its ``k``
    consecutive rows (``M = torch.cat(blocks of ranks 0..n-1)``). It must
    return its block of columns: ``M.chunk(world_size, dim=1)[r]``.
    """
    import torch

    lab = lab_or_current(lab)
    n = lab.world_size
    for k, width in ((1, 1), (2, 2), (2, 1)):
        # distinct values, so that a piece in the wrong place shows
        matrix = torch.randperm(n * k * n * width, generator=_draw()).float().reshape(n * k, n * width)
        inputs = [block.clone() for block in matrix.chunk(n, dim=0)]
        got = _answers("rows_to_columns", inputs, lab, timeout)
        expected = [column.clone() for column in matrix.chunk(n, dim=1)]
        compare(f"rows_to_columns(block) with block shape {list(inputs[0].shape)}", expected,
                [answer for answer, _ in got],
                hint="cut block into world_size pieces along dim=1 (piece j goes to rank j), "
                     "all_to_all them, and torch.cat what arrives along dim=0, in rank order.")
    passed("every rank turned its block of rows into its block of columns.")
