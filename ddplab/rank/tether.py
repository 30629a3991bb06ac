"""Run a Python module tethered to the process that started us: exit when it dies.

ddplab launches ipyparallel's controller and engines as
``python -m ddplab.rank.tether MODULE ARGS...``. The tether:

1. watches its parent (the notebook kernel, whose pid is in
   ``DDPLAB_PARENT_PID``): if the kernel dies, even by ``kill -9``, this
   process exits within about a second, and the controller's tether also
   removes the lab's directory. No orphans hold ports, memory or GPUs.
2. optionally imports modules first (``DDPLAB_PRELOAD=torch``) so an engine
   loads torch while the controller is still starting, not afterwards.
3. runs MODULE in this same process (``runpy``), so the pid ipyparallel
   records is the pid of the real engine, the one ddplab.procs signals.
4. is a child subreaper (``procs.become_subreaper``): a process the rank's
   code detaches (double fork, ``setsid``, SIGTERM ignored) is adopted by
   the engine instead of init, so it stays in the engine's tree, which
   ``lab.stop()`` ends; and the tether ends every descendant when MODULE
   returns or the kernel dies.
"""

from __future__ import annotations

import importlib
import os
import runpy
import shutil
import sys
import threading
import time

POLL_SECONDS = 0.5


def _end_children() -> None:
    # The controller forks its schedulers; os._exit would leave them behind. As a
    # subreaper, our descendants include every orphan the rank's code detached.
    from ddplab import procs
    procs.end_descendants(grace=1)


def exit_with_parent(parent_pid: int, cleanup_dir: str | None = None) -> threading.Thread:
    """Start a daemon thread that ends this process when ``parent_pid`` is gone."""

    def watch() -> None:
        from ddplab.procs import parent_gone
        while not parent_gone(parent_pid):
            time.sleep(POLL_SECONDS)
        _end_children()
        if cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)
        if os.getsid(0) == os.getpid():
            # We lead our session: end what our code started in it, orphans included.
            from ddplab import procs
            tree = procs.Tree()
            tree.add_session(os.getpid())
            tree.end(grace=0)
        # os._exit: the main thread may be blocked inside a C++ collective,
        # where no Python-level shutdown could ever run.
        os._exit(3)

    thread = threading.Thread(target=watch, name="ddplab-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m ddplab.rank.tether MODULE [ARGS...]")
    try:
        # A session (and process group) of our own, as an engine forked by the
        # template already has: ddplab ends it as a group, with everything the
        # rank's code started in it.
        os.setsid()
    except OSError:
        pass                                # already a session leader
    parent = os.environ.get("DDPLAB_PARENT_PID")
    if parent:
        exit_with_parent(int(parent), os.environ.get("DDPLAB_CLEANUP_DIR") or None)
    for name in filter(None, os.environ.get("DDPLAB_PRELOAD", "").split(",")):
        importlib.import_module(name)
    from ddplab import procs
    procs.become_subreaper()
    module, sys.argv = argv[0], argv
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        _end_children()


if __name__ == "__main__":
    main(sys.argv[1:])
