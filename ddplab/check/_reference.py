"""Exercises that build all_reduce by hand may not call the one ddplab ships.

``ddplab.algorithms`` holds the reference solutions of notebook 06 (naive,
ring, recursive doubling, tree). An answer that imports and calls one sums
correctly without building anything; ``refusing_reference`` makes every
send, recv, reduce and broadcast made from inside those functions raise an
``AssertionError`` that says so.
"""

from __future__ import annotations

from ._core import swap_peer_calls

#: ddplab's own all_reduces (``ddplab.algorithms``): the reference solutions an answer may not call.
_REFERENCES = ("naive_all_reduce", "naive_all_reduce_collectives", "recursive_doubling_all_reduce",
               "ring_all_reduce", "tree_all_reduce")
#: The calls a reference all_reduce in ``ddplab.algorithms`` makes: one of them shows it running.
_REFERENCE_CALLS = ("send", "recv", "isend", "irecv", "reduce", "broadcast")


def refusing_reference(exercise: str):
    """A context manager: a call from inside ``ddplab.algorithms``' own all_reduces raises.

    An answer that calls the shipped reference (``ddplab.algorithms.ring_all_reduce``,
    under any name it was imported as) sums correctly without building anything.
    Each send, recv, reduce or broadcast looks up the call stack for a frame of
    a reference function's code; a copy of that code (a student's own) is not it.
    """
    import contextlib
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ddplab import algorithms

    references = {getattr(algorithms, name).__code__: name for name in _REFERENCES}

    def refusing(name, real):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code in references:
                    raise AssertionError(
                        f"{exercise} calls ddplab.algorithms.{references[frame.f_code]}, the "
                        f"reference solution that ships with ddplab, so it builds nothing itself. "
                        f"Write the sends and receives yourself.")
                frame = frame.f_back
            return real(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def refuse():
        undo = swap_peer_calls(lambda name, keyword, real: refusing(name, real))
        saved = {(module, name): getattr(module, name) for module in (dist, c10d)
                 for name in ("reduce", "broadcast")}
        for name in ("reduce", "broadcast"):
            replacement = refusing(name, saved[(dist, name)])
            for module in (dist, c10d):
                setattr(module, name, replacement)
        try:
            yield
        finally:
            for (module, name), value in saved.items():
                setattr(module, name, value)
            undo()
    return refuse()
