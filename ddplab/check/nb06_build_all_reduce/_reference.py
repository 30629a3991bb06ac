"""Exercises that build all_reduce by hand may not call the one ddplab ships.

``ddplab.algorithms`` holds the reference solutions of notebook 06 (naive,
ring, recursive doubling, tree). An answer that imports and calls one sums
correctly without building anything; ``refusing_reference`` makes every
send, recv, reduce and broadcast made from inside those functions raise a
``Feedback`` that says so.
"""

from __future__ import annotations

from .._feedback import Feedback
from .._peers import swap_peer_calls

#: ddplab's own all_reduces (``ddplab.algorithms``): the reference solutions an answer may not call.
_REFERENCES = ("naive_all_reduce", "naive_all_reduce_collectives", "recursive_doubling_all_reduce",
               "ring_all_reduce", "tree_all_reduce")
#: The calls a reference all_reduce in ``ddplab.algorithms`` makes: one of them shows it running.
_REFERENCE_CALLS = ("send", "recv", "isend", "irecv", "reduce", "broadcast")


#: Instructions whose argument is a name the code reaches outside itself (kept in ``shape``).
_NAMED = ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME", "STORE_ATTR", "IMPORT_NAME",
          "IMPORT_FROM")
#: Fewer instructions than this, and a function's shape is one an honest answer may share.
_COPIED = 50
#: Instructions that say nothing of what the code does (and differ between compiles).
_NOISE = ("CACHE", "NOP", "PRECALL", "RESUME", "EXTENDED_ARG")


def shape(code) -> tuple:
    """What a function does, as a tuple that a copy of its source keeps, however compiled.

    The instruction names, with the global and attribute names they use; not
    local variable names, constants or jump targets (renaming a local, editing
    the docstring or a number keeps the shape), not the compiler's flags
    (``co_code`` differs between a module's compile and a cell's ``exec``:
    ``LOAD_METHOD`` there is ``LOAD_ATTR`` here, for ``dist.get_rank()``).
    """
    import dis

    return tuple((("LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname),
                  (i.argval if i.opname in _NAMED else None))
                 for i in dis.get_instructions(code) if i.opname not in _NOISE)


def refusing_reference(exercise: str):
    """A context manager: a call from inside ``ddplab.algorithms``' own all_reduces raises.

    An answer that calls the shipped reference (``ddplab.algorithms.ring_all_reduce``,
    under any name it was imported as) sums correctly without building anything.
    Each send, recv, reduce or broadcast looks up the call stack for a frame of
    a reference function's code, recognised by content (``shape``), not by
    identity: the reference's source read from the installed file and exec'd
    under the student's name is still the reference.
    """
    import contextlib
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ddplab import algorithms

    seen: dict = {}

    def content(code):
        if code not in seen:
            seen[code] = shape(code)
        return seen[code]

    codes = {getattr(algorithms, name).__code__: name for name in _REFERENCES}
    # A copy is recognised by its shape only where the shape is long enough that only a
    # copy has it: two lines of reduce-then-broadcast are what every honest answer writes.
    shapes = {content(code): name for code, name in codes.items() if len(content(code)) >= _COPIED}

    def refusing(name, real):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                found = codes.get(frame.f_code) or shapes.get(content(frame.f_code))
                if found:
                    raise Feedback(f"{exercise} runs ddplab.algorithms.{found} (the reference "
                                   f"solution that ships with ddplab, called or copied), so it "
                                   f"builds nothing itself.",
                                   hint="write the sends and receives yourself.")
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
