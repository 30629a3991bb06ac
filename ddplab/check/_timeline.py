"""What the checkers of a timeline share: the trace they read.

The student traces a cell, reads the picture, and writes down what it shows:

    with lab.trace() as tr:
        lab.run(ddplab.trace.uneven_work)
    tr                                      # the picture
    ddplab.check.straggler(2)               # "rank 2 is the one the others waited for"

Each such checker (``straggler`` in 02b, ``who_waited`` in 01,
``ddp_all_reduces`` in 05, ``messages_per_rank`` in 06; marked
``@checker(reads_trace=True)``) works the answer out again from the trace's
own events (the given ``trace``, else the one that stopped last), never from
a stored value: if the run changes, so does the right answer. A wrong answer
raises a ``Feedback`` that says why the answer is wrong and how to read the
picture. Which rank or call is right is never said, and no measured time
(which would point at it); a count is said as the trace holds it only where
the student's own count is what is in question (``messages_per_rank``).
"""

from __future__ import annotations

from typing import Any

from ._feedback import Feedback


def traced(trace: Any, checker: str) -> Any:
    """The trace to read: ``trace``, else the one that stopped last; a ``Feedback`` if there is none."""
    from .. import trace as tracing

    trace = trace if trace is not None else tracing.last()
    if trace is None or trace.events is None:
        raise Feedback(f"ddplab.check.{checker} reads the timeline of the traced cell above, but "
                       f"there is none yet.",
                       hint="run that cell first (`with lab.trace() as tr:` or `%%ranks --trace`), "
                            "then this check.")
    return trace


def needs_int(answer: Any, example: str) -> None:
    """A ``Feedback`` unless ``answer`` is a whole number (``True`` is not one)."""
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise Feedback(f"answer with a number, e.g. {example}; got {answer!r}.")
