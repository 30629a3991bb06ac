"""The one lab ``ddplab.current()``, ``%%ranks`` and the checkers use.

A kernel has at most one current lab: the one started (or restarted) last.
``ddplab.lab.session`` makes a lab current as it starts it; ``Lab.stop()``
stops it being current; ``Lab.restart()`` of a stopped lab makes it current
again unless another lab runs by then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DdplabError

if TYPE_CHECKING:
    from .lab import Lab

_current: "Lab | None" = None


def current() -> "Lab":
    """The lab started last and still running; raises if there is none."""
    if _current is None or not _current.running:
        raise DdplabError("ddplab: no lab is running. Start one with lab = ddplab.start(world_size=2).")
    return _current


def current_or_none() -> "Lab | None":
    """The lab made current last, running or not, or None."""
    return _current


def make_current(lab: "Lab | None") -> None:
    """Make ``lab`` the one ``current()``, ``%%ranks`` and the checkers use."""
    global _current
    _current = lab


def forget(lab: "Lab") -> None:
    """``lab`` stopped: it is current no more (if it was)."""
    if _current is lab:
        make_current(None)


def offer(lab: "Lab") -> None:
    """``lab`` runs again: make it current unless another lab runs as the current one."""
    if _current is None or _current is lab or not _current.running:
        make_current(lab)
