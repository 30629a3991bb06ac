"""On a rank: keep what C++ code writes to file descriptors 1 and 2 out of a cell's output.

torch logs some errors itself, from C++, straight to stderr, with a time stamp and a
process id: a demo that fails on purpose (notebook 09's ``monitored_barrier``) would show a
different line on every run. Inside ``hide_fd_output()`` what reaches fds 1 and 2 is dropped;
``print`` still shows::

    from ddplab.quiet import hide_fd_output

    def skip_the_barrier():
        ...
        with hide_fd_output():         # torch also logs the error on stderr, time-stamped
            dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=1))

Student code rarely needs it: it is for output that must read the same from run to run.
The capture it pauses is the rank's (``ddplab.rank.output``), which owns it.
"""

from __future__ import annotations

from .rank.output import hide_fd_output

__all__ = ["hide_fd_output"]
