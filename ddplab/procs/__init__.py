"""The one place that starts, watches and ends process trees.

Two layers, one owner:

- ``tree``: ``start`` one command (the only ``Popen`` in ddplab), ``run_command``
  a short one to its end (the only ``subprocess.run``), and end a
  whole tree of processes by one policy, ``Tree.end``: freeze, SIGTERM children
  before parents, ``grace`` seconds, SIGKILL, wait until all are gone; never a
  reused pid. A lab's controller and engines, and the engine template's
  forks, are ended this way.
- ``group``: ``Group``, a set of commands run as one job, one per rank (torch
  elastic's ``PContext``, in small): start them, collect or stream their output
  by rank, wait with a timeout and a settle time after the first failure, end
  the whole tree, return how each rank ended. ``ddplab.launch``,
  ``ddplab.train``, ``ddplab grade`` and the engine template use it.

- ``reaper``: ``become_subreaper`` (or ``adopting``, for a block), so that orphans a process's descendants
  leave (double fork, ``setsid``) stay its descendants, and
  ``end_descendants`` to end them all; engines and grading workers use it.
  ``parent_gone``: whether the process that started this one has exited,
  what every watcher of the kernel polls.

``tools/check_layout.py`` holds every other module to it: only this package
calls ``Popen`` or ``subprocess.run`` or signals a process.
"""

from __future__ import annotations

from .group import Exit, Group, Results, run
from .reaper import adopting, become_subreaper, end_descendants, hide_memory, parent_gone
from .tree import (
                   BUSY_SHARE,
                   END_GRACE_S,
                   KILL_WAIT_S,
                   Member,
                   Tree,
                   alive,
                   cpu_times,
                   cpu_used,
                   descendants,
                   end_tree,
                   process,
                   reap_adopted,
                   run_command,
                   send,
                   start,
)

__all__ = ["BUSY_SHARE", "END_GRACE_S", "Exit", "Group", "KILL_WAIT_S", "Member", "Results", "Tree",
           "adopting", "alive", "become_subreaper", "cpu_times", "cpu_used", "descendants", "end_descendants",
           "end_tree", "hide_memory", "parent_gone", "process", "reap_adopted", "run", "run_command",
           "send", "start"]
