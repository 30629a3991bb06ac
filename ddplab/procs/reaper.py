"""Adopt what detaches: a process that is a *child subreaper* inherits its orphans.

A rank's or a submission's code can leave a process that no tree finds: it
double-forks, calls ``setsid``, ignores SIGTERM, and its parent exits. Linux
hands such an orphan to the nearest ancestor that called
``prctl(PR_SET_CHILD_SUBREAPER)`` instead of to init, so it stays a
descendant of that ancestor, and ``Tree.end``/``end_descendants`` reach it.
An engine's guard and a grading worker are subreapers, and end every
descendant, adopted orphans included, before they exit.
"""

from __future__ import annotations

import ctypes
import logging
import os

from .tree import descendants, end_tree

log = logging.getLogger(__name__)
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(option, value, 0, 0, 0) == 0:
            return True
        log.debug("ddplab: prctl(%d, %d) failed: errno %d", option, value, ctypes.get_errno())
    except (OSError, AttributeError):
        log.debug("ddplab: no prctl here", exc_info=True)
    return False


def become_subreaper() -> bool:
    """Make this process inherit its descendants' orphans; whether the OS allowed it (Linux only)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def hide_memory() -> bool:
    """Make this process non-dumpable: a process of the same user (a submission's kernel)
    can no longer ptrace it or read its memory and open files through /proc."""
    return _prctl(PR_SET_DUMPABLE, 0)


def parent_gone(parent_pid: int) -> bool:
    """Whether the process that started this one (``parent_pid``) has exited.

    A process whose parent exits is re-parented (to init, or to the nearest
    subreaper), so its ppid changes: cheaper than ``kill(pid, 0)``, and never
    fooled by another process that got the same pid. An engine's guard, the
    engine template and the MPI watcher each poll it to end themselves, and
    what they started, when the kernel is gone.
    """
    return os.getppid() != parent_pid


def end_descendants(grace: float = 1.0) -> list:
    """End every process below this one (adopted orphans included); return survivors (normally none)."""
    return end_tree(*descendants(os.getpid()), grace=grace)
