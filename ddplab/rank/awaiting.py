"""Top-level ``await`` in a ``%%ranks`` cell, as IPython allows it in a notebook cell.

IPython compiles a cell with ``ast.PyCF_ALLOW_TOP_LEVEL_AWAIT``: a cell that
awaits at its top level becomes a coroutine, which IPython runs to its end
(its "autoawait"). A rank runs its cells itself (``engine.run_cell``), so it
does the same here: ``compile`` with that flag, and a code object whose flags
say ``CO_COROUTINE`` is run on an event loop of its own.

Why a loop of its own: the rank is an ipyparallel engine, whose kernel runs the
cell from inside its own asyncio loop, so ``asyncio.run`` there fails ("cannot
be called from a running event loop"). The engine's loop is stopped in our
call while the cell runs, so the cell's loop takes the thread for that time
(``asyncio._set_running_loop``, the hook asyncio gives loop implementations)
and gives it back after. The cell still runs in the main thread: an interrupt
(lab.interrupt) and the hang report's stack reach it as for any cell.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from types import CodeType, FrameType
from typing import Any

#: Compile flags of a rank cell: top-level ``await``, ``async for``, ``async with`` allowed.
FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
#: The coroutine of the cell that awaits now, if one does (``suspended`` reads it).
_running: list[Any] = []


def compile_cell(tree: ast.AST, filename: str, mode: str) -> CodeType:
    """``compile`` as a notebook cell is compiled: top-level ``await`` allowed."""
    return compile(tree, filename, mode, flags=FLAGS)


def run(code: CodeType, namespace: dict) -> Any:
    """``eval(code, namespace)``; a cell that awaits is run to its end on a loop of its own."""
    if not code.co_flags & inspect.CO_COROUTINE:
        return eval(code, namespace)
    outer = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    loop = asyncio.new_event_loop()
    _running[:] = [eval(code, namespace)]
    try:
        return loop.run_until_complete(_running[0])
    finally:
        _running.clear()
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            asyncio._set_running_loop(outer)


def suspended() -> list[FrameType]:
    """The frames of the awaiting cell, innermost first, while it is suspended at an ``await``
    (the stack then shows asyncio's loop in ``select``, not the cell); [] when none is.

    Followed through each coroutine's ``cr_await``: the cell's frame, then what it awaits
    (``asyncio.sleep``'s), and so on inward.
    """
    frames, awaited = [], _running[0] if _running else None
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return frames[::-1]

