"""Checkers for notebook 05, DDP training: gradients averaged by hand, DDP itself, and the trace.

    ddplab.check.average_gradients()        # DDP by hand (``byhand``)
    ddplab.check.wrap_model()               # DDP, its data, its checkpoints (``training``)
    ddplab.check.ddp_all_reduces(3)         # read off the timeline (here, ``_timeline``)
"""

from __future__ import annotations

from typing import Any

from .._core import checker, passed
from .._feedback import Feedback
from .._timeline import needs_int, traced
from .byhand import *  # noqa: F401,F403
from .byhand import __all__ as _byhand
from .training import *  # noqa: F401,F403
from .training import __all__ as _training

__all__ = sorted([*_byhand, *_training, "ddp_all_reduces"])


@checker(reads_trace=True)
def ddp_all_reduces(answer: Any, trace: Any = None) -> None:
    """How many all_reduces did DDP issue during one backward (the last one on rank 0)?"""
    __tracebackhide__ = True
    trace = traced(trace, "ddp_all_reduces")
    rank = trace.ranks[0]
    backwards = [c for c in trace.compute if c.rank == rank and c.op == "backward"]
    if not backwards:
        raise Feedback(f"the trace holds no backward pass on rank {rank}.",
                       hint="trace a cell that calls loss.backward() on a DDP model.")
    last = backwards[-1]
    issued = [e for e in trace.on(rank) if e.op == "all_reduce" and e.source == "torch"
              and last.start <= e.start <= last.end]
    needs_int(answer, "ddplab.check.ddp_all_reduces(3)")
    if answer != len(issued):
        everywhere = sum(1 for e in trace.on(rank) if e.op == "all_reduce" and e.source == "torch")
        if answer == everywhere:
            why = ("that counts the all_reduces of every backward in the trace (each training step "
                   "has its own backward); count only those of the last one")
        else:
            why = (f"DDP issued {'fewer' if answer > len(issued) else 'more'} during the last "
                   f"backward on rank {rank}")
        raise Feedback(f"{answer} all_reduce(s) is not what DDP issued during the last backward: "
                       f"{why}.",
                       hint="count the purple 'by torch' bars that start inside the last grey "
                            "backward box; each is one gradient bucket.")
    passed(f"DDP issued {len(issued)} bucket all_reduce(s) while backward was still running.")
