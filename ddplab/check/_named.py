"""Notebooks 02 and 02b: the student's function, found by name on each rank, on inputs drawn here.

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
ranks cannot change that reference. The expected values a table shows are
made from those drawn inputs: a function's results, never a number to copy.

A function that raises fails the check with the student's exception and
traceback; one that deadlocks fails it with where each rank is stuck (the lab
then needs ``lab.restart()``). Both come as ``Feedback``, like a wrong answer.
"""

from __future__ import annotations

from typing import Any

from ._core import MISSING, require_function, run_student_code

__all__ = ["CHECK_TIMEOUT", "answers", "draw", "integers", "plain", "said"]

CHECK_TIMEOUT = 60.0


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


def answers(name: str, inputs: list[Any], lab: Any, timeout: float) -> list[list[Any]]:
    """``_call`` on every rank, rank ``r`` sent only ``inputs[r]`` (``Lab.run_each``); results by rank.

    A missing function, an exception or a hang becomes a ``Feedback``.
    """
    got = run_student_code(f"{name}(...)", _call, name, lab=lab, timeout=timeout,
                           hint="every rank of a group must call the same collectives in the "
                                "same order.", each={rank: (x,) for rank, x in enumerate(inputs)})
    got = [got[rank] for rank in range(len(inputs))]
    require_function(got, name)
    return got


def draw() -> Any:
    """A generator seeded now, from a seed no rank sees: each check's inputs are new."""
    import secrets

    import torch

    return torch.Generator().manual_seed(secrets.randbits(62))


def integers(generator: Any, rank: int, shape: tuple[int, ...]) -> Any:
    """Small whole numbers as float32, distinct per draw and rank: sums and means stay exact."""
    import torch

    return torch.randint(-9, 10, shape, generator=generator).float() + 20 * rank


def said(inputs: list[Any]) -> str:
    """Every rank's input, for the first line of a failure: ``[1.0, 2.0] on rank 0, ...``."""
    return ", ".join(f"{x.tolist() if hasattr(x, 'tolist') else x!r} on rank {rank}"
                     for rank, x in enumerate(inputs))


def plain(value: Any) -> Any:
    """A one-element tensor as a Python number, so 3.0 and tensor(3.) compare equal."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        return value.item()
    return value


