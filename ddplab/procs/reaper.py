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

import contextlib
import ctypes
import logging
import os
from typing import Iterator

from .tree import descendants, end_tree, reap_adopted

log = logging.getLogger(__name__)
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
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


def _is_subreaper() -> bool:
    value = ctypes.c_int(0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0 and bool(value.value)
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def adopting(settle: float = 2.0) -> Iterator[None]:
    """Within the block, this process is a child subreaper; leaving it, it reaps what it adopted.

    For a process that runs sandboxes (``ddplab grade``): each sandbox leaves an
    orphan as it ends (``reap_adopted``), which would otherwise go to init, and a
    container's init that is not a real one (a program run as pid 1) never reaps
    it: one ``[bwrap] <defunct>`` per submission, for as long as the machine runs.
    The caller reaps as each sandbox ends; leaving, every orphan still running
    gets ``settle`` seconds to end. A process that was a subreaper before stays one.
    """
    was = _is_subreaper()
    become_subreaper()
    try:
        yield
    finally:
        reap_adopted(settle=settle)
        if not was:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)


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
