"""Is this rank blocked inside a torch.distributed call, and where? Asked from a side thread.

The live view (``ddplab.rank.live``) shows a short status beside each rank's
label while a cell runs; "blocked in recv, cell line 3" is the useful one: a
rank waiting for a partner that has not called yet.

How we know, at no cost to the rank's own code: nothing is wrapped. The live
pump's thread already wakes every ``live.INTERVAL`` seconds; each time it reads
the main thread's Python stack with ``sys._current_frames()`` (a snapshot,
safe from another thread, and possible while the main thread sits in a C++
collective, which releases the GIL while it waits). The outermost public
function of ``distributed_c10d.py`` on that stack is the call the rank is in.
A ``.wait()`` on the handle an ``isend`` returned is a C++ method with no
Python frame: a rank waiting there reads as running.

A tight loop of small ``all_reduce`` calls is inside ``all_reduce`` at almost
every look, yet it is not blocked. So "blocked" needs the *same* call seen for
``BLOCKED_AFTER`` seconds. "The same call" is the same frame object: the
``Watch`` keeps a reference to the frame it last saw, so that object cannot be
freed and its id reused by the next call (a new call always gets a new frame
object). The reference is dropped at the next look once the call is over.

The hang diagnosis (``ddplab.lab.diagnose``) asks the same question from the
kernel with faulthandler's dump, for a rank that may no longer run any Python.
"""

from __future__ import annotations

import sys
import time
from types import FrameType

#: Seconds one call must last before the rank counts as blocked in it.
BLOCKED_AFTER = 0.4
#: The start of a rank cell's filename: ``engine.CELL_FILENAME`` ("<rank cell 3>").
#: Spelled out here because ``engine`` imports this module, not the other way round.
CELL_PREFIX = "<rank cell "
_C10D_FILE = "/torch/distributed/distributed_c10d.py"
_LIBRARY_MARKS = ("site-packages", "/lib/python", "/ddplab/")


def _call_frame(top: FrameType | None) -> FrameType | None:
    """The outermost frame of a public ``torch.distributed`` function on this stack, if any.

    Outermost: the call the user made. ``all_gather_object`` waits inside
    ``all_gather``, ``send_object_list`` inside ``send``; the student wrote the former.
    """
    frame, found = top, None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_C10D_FILE) and not code.co_name.startswith("_"):
            found = frame
        frame = frame.f_back
    return found


def _user_site(frame: FrameType | None) -> str:
    """Where the user's code made the call: ``cell line 3``, ``train line 12``, or ""."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(CELL_PREFIX):
            return f"cell line {frame.f_lineno}"
        if not filename.startswith("<") and not any(m in filename for m in _LIBRARY_MARKS):
            return f"{frame.f_code.co_name} line {frame.f_lineno}"
        frame = frame.f_back
    return ""


def describe(frame: FrameType) -> str:
    """``blocked in recv, cell line 3`` for the frame of a torch.distributed call."""
    site = _user_site(frame.f_back)
    return f"blocked in {frame.f_code.co_name}" + (f", {site}" if site else "")


class Watch:
    """Looks at one thread's stack on each ``look()``; says whether it is blocked, and where."""

    def __init__(self, thread_id: int) -> None:
        self._thread_id = thread_id
        self._frame: FrameType | None = None     # the call seen at the last look
        self._since = 0.0

    def look(self, now: float | None = None) -> str:
        """The status text (``blocked in send, cell line 1``), or "" while not blocked."""
        now = time.monotonic() if now is None else now
        frame = _call_frame(sys._current_frames().get(self._thread_id))
        if frame is None or frame is not self._frame:
            self._frame, self._since = frame, now
            return ""
        return describe(frame) if now - self._since >= BLOCKED_AFTER else ""

    def forget(self) -> None:
        """Drop the frame held, and the locals it keeps alive (at the end of a cell)."""
        self._frame = None
