"""Checkers for notebook 06, all_reduce built by hand, and the messages it sends on the timeline.

    ddplab.check.ring_all_reduce(my_ring_all_reduce)     # against dist.all_reduce (``methods``)
    ddplab.check.messages_per_rank(6)                    # read off the timeline (here)

``_messages`` follows a function's sends and receives on every rank;
``_reference`` refuses the reference solutions that ship in ``ddplab.algorithms``.
"""

from __future__ import annotations

from typing import Any

from .._core import checker, passed
from .._feedback import Feedback, Row
from .._timeline import needs_int, traced
from .methods import *  # noqa: F401,F403
from .methods import __all__ as _methods

__all__ = sorted([*_methods, "messages_per_rank"])


@checker(reads_trace=True)
def messages_per_rank(answer: Any, trace: Any = None) -> None:
    """How many messages (``send`` + ``isend``) did each rank send in the traced run?

    A count the trace does not hold is answered with the student's count and
    which way it is off (issue 64: "did not send 6: too many" said neither),
    never with the traced count or the gap: either is the answer. Where the
    traced run is not a plain ring (each rank sent other than a ring's two
    passes of p - 1), that is said too: the count may be right for a ring and
    the ring itself the mistake.
    """
    __tracebackhide__ = True
    trace = traced(trace, "messages_per_rank")
    counts = {r: sum(1 for e in trace.on(r) if e.op in ("send", "isend")) for r in trace.ranks}
    if len(set(counts.values())) != 1:
        raise Feedback("the ranks did not all send the same number of messages in the traced run.",
                       rows=[Row(r, f"{n} sent") for r, n in counts.items()],
                       hint="trace a cell that runs the same all_reduce on every rank.")
    truth = next(iter(counts.values()))
    needs_int(answer, "ddplab.check.messages_per_rank(4)")
    if answer != truth:
        if answer == 2 * truth:
            why = ": that counts the receives too (an arrow's both ends); count only what one rank sends"
        elif answer == truth * len(trace.ranks):
            why = ": that is every rank's messages together; the question is per rank"
        else:
            why = ""
        ring = 2 * (len(trace.ranks) - 1)          # what a plain ring sends: never shown
        detail = ([f"the traced run is not a plain ring: each rank sent {'more' if truth > ring else 'fewer'}"
                   f" messages than a ring's reduce-scatter and all-gather send, so the ring itself "
                   f"differs from a ring (see the ring exercise's check)"] if truth != ring else [])
        raise Feedback(
            f"your count, {answer}, is {'more' if answer > truth else 'fewer'} than the messages each "
            f"rank sent in the traced run{why}.",
            rows=[Row(r, f"{answer} (too {'many' if answer > truth else 'few'})", wrong=True)
                  for r in counts],
            detail=detail,
            hint="count the arrows leaving one rank's lane (a send or isend each). The traced run "
                 "is the last traced cell that ran: trace the all_reduce cell again if another "
                 "traced cell ran after it.")
    passed(f"each rank sent {truth} messages.")
