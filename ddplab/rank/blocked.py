"""Is this rank blocked inside a torch.distributed call, and where? Asked from a side thread.

The live view (``ddplab.rank.live``) shows a short status beside each rank's
label while a cell runs; "blocked in recv, cell line 3" is the useful one: a
rank waiting for a partner that has not called yet.

How we know, at no cost to the rank's own code: nothing is wrapped. The live
pump's thread already wakes every ``live.INTERVAL`` seconds; each time it reads
the main thread's Python stack with ``sys._current_frames()`` (a snapshot,
safe from another thread, and possible while the main thread sits in a C++
collective, which releases the GIL while it waits), and ``ddplab.rank.where``
finds on it the call the rank is in and the user's line that made it.
A ``.wait()`` on the handle an ``isend`` returned is a C++ method with no
Python frame: a rank waiting there reads as running.

A tight loop of small ``all_reduce`` calls is inside ``all_reduce`` at almost
every look, yet it is not blocked. So "blocked" needs the *same* call seen for
``BLOCKED_AFTER`` seconds. "The same call" is the same frame object: the
``Watch`` keeps a reference to the frame it last saw, so that object cannot be
freed and its id reused by the next call (a new call always gets a new frame
object). The reference is dropped at the next look once the call is over.

The hang diagnosis (``ddplab.lab.diagnose``) asks the same question from the
kernel with faulthandler's dump, for a rank that may no longer run any Python;
``where`` answers both, in the same words.
"""

from __future__ import annotations

import sys
import time
from types import FrameType

from . import where

#: Seconds one call must last before the rank counts as blocked in it.
BLOCKED_AFTER = 0.4


def _stack(top: FrameType | None) -> list[FrameType]:
    frames = []
    while top is not None:
        frames.append(top)
        top = top.f_back
    return frames


def look_at(top: FrameType | None) -> tuple[FrameType | None, str]:
    """The frame of the torch.distributed call on this stack (None if none), and its status.

    The status is ``where.Where.blocked()``'s: ``blocked in recv, cell line 3``.
    """
    frames = _stack(top)
    found = where.locate(map(where.record, frames))
    if found.call_at is None:
        return None, ""
    return frames[found.call_at], found.blocked()


class Watch:
    """Looks at one thread's stack on each ``look()``; says whether it is blocked, and where."""

    def __init__(self, thread_id: int) -> None:
        self._thread_id = thread_id
        self._frame: FrameType | None = None     # the call seen at the last look
        self._since = 0.0

    def look(self, now: float | None = None) -> str:
        """The status text (``blocked in send, cell line 1``), or "" while not blocked."""
        now = time.monotonic() if now is None else now
        frame, status = look_at(sys._current_frames().get(self._thread_id))
        if frame is None or frame is not self._frame:
            self._frame, self._since = frame, now
            return ""
        return status if now - self._since >= BLOCKED_AFTER else ""

    def held_for(self, now: float | None = None) -> float | None:
        """Seconds the thread has been in the one torch.distributed call seen at the last looks
        (None while it is in none): how long a rank has waited, for the kernel's hang rules."""
        if self._frame is None:
            return None
        return (time.monotonic() if now is None else now) - self._since

    def forget(self) -> None:
        """Drop the frame held, and the locals it keeps alive (at the end of a cell)."""
        self._frame = None
