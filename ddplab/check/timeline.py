"""Checkers for exercises whose answer is read off a timeline (``lab.trace()``).

The student traces a cell, reads the picture, and writes down what it shows:

    with lab.trace() as tr:
        lab.run(ddplab.trace.uneven_work)
    tr                                      # the picture
    ddplab.check.straggler(2)               # "rank 2 is the one the others waited for"

Each checker works the answer out again from the trace's own events (the
given ``trace``, else the one that stopped last), never from a stored value:
if the run changes, so does the right answer. A wrong answer raises an
``AssertionError`` that says why the answer is wrong and how to read the
picture, never what the right answer is: no right rank, count or call, and no
measured time (which would point at it).
"""

from __future__ import annotations

from typing import Any

from ._core import passed

__all__ = ["ddp_all_reduces", "messages_per_rank", "straggler", "who_waited"]


def _trace(trace: Any, checker: str) -> Any:
    from .. import trace as tracing

    trace = trace if trace is not None else tracing.last()
    if trace is None or trace.events is None:
        raise AssertionError(f"ddplab.check.{checker} reads the timeline of the traced cell above, "
                             f"but there is none yet. Run that cell first (`with lab.trace() as "
                             f"tr:` or `%%ranks --trace`), then this check.")
    return trace


def straggler(answer: Any, trace: Any = None) -> None:
    """Which rank did the others wait for in the collectives? ``answer``: a rank number."""
    __tracebackhide__ = True
    trace = _trace(trace, "straggler")
    truth = trace.straggler()
    if truth is None:
        raise AssertionError("in this trace no rank waited for another in a collective, so there "
                             "is no straggler to find. Re-run the traced cell above.")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise AssertionError(f"answer with a rank number, e.g. ddplab.check.straggler(0); "
                             f"got {answer!r}.")
    if answer != truth:
        raise AssertionError(f"rank {answer} is not the straggler: {_not_straggler(trace, answer)}\n"
                             f"Hint: the straggler is the rank whose collective box has no "
                             f"hatching; everyone else's box is hatched while they wait for it "
                             f"to arrive.")
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


def who_waited(answer: Any, trace: Any = None) -> None:
    """Which call waited longest, on which rank? ``answer``: ``(rank, op)``, e.g. ``(1, "recv")``."""
    __tracebackhide__ = True
    trace = _trace(trace, "who_waited")
    waits = [e for e in trace.events if e.waited > 0]
    if not waits:
        raise AssertionError("in this trace no call waited for another rank. Re-run the traced "
                             "cell above.")
    longest = max(waits, key=lambda e: e.waited)
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise AssertionError(f"answer with (rank, op), e.g. ddplab.check.who_waited((1, 'recv')); "
                             f"got {answer!r}.")
    rank, op = answer
    if (rank, op) != (longest.rank, longest.op):
        raise AssertionError(f"({rank!r}, {op!r}) is not the call that waited longest: "
                             f"{_why_not(trace, rank, op)}\nHint: waiting is the hatched part of "
                             f"a box; find the longest hatching, then its rank (the lane) and "
                             f"its op (the label; a wait() is \"wait\").")
    passed(f"{longest.op} on rank {longest.rank} waited longest, for the other rank.")


def _why_not(trace: Any, rank: Any, op: Any) -> str:
    """Why ``(rank, op)`` is wrong, without giving away the right call or its time."""
    if rank not in trace.ranks:
        return f"the trace has ranks {', '.join(map(str, trace.ranks))}, and no rank {rank!r}."
    ops = sorted({e.op for e in trace.on(rank)})
    if op not in ops:
        return (f"rank {rank} made no {op!r} call in this trace; it made "
                f"{', '.join(repr(o) for o in ops) or 'none'}.")
    if not any(e.waited > 0 for e in trace.on(rank) if e.op == op):
        return f"{op} on rank {rank} did not wait for the other rank at all in this trace."
    return f"{op} on rank {rank} waited, but another call waited longer."


def ddp_all_reduces(answer: Any, trace: Any = None) -> None:
    """How many all_reduces did DDP issue during one backward (the last one on rank 0)?"""
    __tracebackhide__ = True
    trace = _trace(trace, "ddp_all_reduces")
    rank = trace.ranks[0]
    backwards = [c for c in trace.compute if c.rank == rank and c.op == "backward"]
    if not backwards:
        raise AssertionError(f"the trace holds no backward pass on rank {rank}. Trace a cell "
                             f"that calls loss.backward() on a DDP model.")
    last = backwards[-1]
    issued = [e for e in trace.on(rank) if e.op == "all_reduce" and e.source == "torch"
              and last.start <= e.start <= last.end]
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise AssertionError(f"answer with a number, e.g. ddplab.check.ddp_all_reduces(3); "
                             f"got {answer!r}.")
    if answer != len(issued):
        everywhere = sum(1 for e in trace.on(rank) if e.op == "all_reduce" and e.source == "torch")
        if answer == everywhere:
            why = ("that counts the all_reduces of every backward in the trace (each training step "
                   "has its own backward); count only those of the last one")
        else:
            why = f"that is too {'many' if answer > len(issued) else 'few'}"
        raise AssertionError(f"DDP did not issue {answer} all_reduce(s) during the last backward "
                             f"on rank {rank}: {why}.\nHint: count the purple 'by torch' bars that "
                             f"start inside the last grey backward box; each is one gradient "
                             f"bucket.")
    passed(f"DDP issued {len(issued)} bucket all_reduce(s) while backward was still running.")


def messages_per_rank(answer: Any, trace: Any = None) -> None:
    """How many messages (``send`` + ``isend``) did each rank send in the traced run?"""
    __tracebackhide__ = True
    trace = _trace(trace, "messages_per_rank")
    counts = {r: sum(1 for e in trace.on(r) if e.op in ("send", "isend")) for r in trace.ranks}
    if len(set(counts.values())) != 1:
        raise AssertionError("the ranks did not all send the same number of messages: "
                             + ", ".join(f"rank {r}: {n}" for r, n in counts.items())
                             + ". Trace a cell that runs the same all_reduce on every rank.")
    truth = next(iter(counts.values()))
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise AssertionError(f"answer with a number, e.g. ddplab.check.messages_per_rank(4); "
                             f"got {answer!r}.")
    if answer != truth:
        if answer == 2 * truth:
            why = "that counts the receives too (an arrow's both ends); count only what one rank sends"
        elif answer == truth * len(trace.ranks):
            why = "that is every rank's messages together; the question is per rank"
        else:
            why = f"that is too {'many' if answer > truth else 'few'}"
        raise AssertionError(f"each rank did not send {answer} message(s) in the traced run: {why}."
                             f"\nHint: count the arrows leaving one rank's lane (a send or isend "
                             f"each).")
    passed(f"each rank sent {truth} messages.")
