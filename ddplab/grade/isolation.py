"""How far a grading worker is kept from the grader: one interface, an implementation per machine.

``ddplab grade`` grades each submission in a worker process of its own
(``ddplab.grade.class_run``), and that worker runs the submission's kernel,
its lab and all they start. What keeps it from the grader's files and
processes depends on what the machine allows, as a JupyterHub spawner or an
ipyparallel launcher depends on where it runs;
``class_run.choose_isolation`` picks one for the whole grading run:

==================  =============================================  ==========================
``Isolation``       where                                          module
==================  =============================================  ==========================
``Bubblewrap``      bwrap can make a sandbox (the default)         ``ddplab.grade.sandbox``
``AnotherAccount``  no sandbox, ``--run-as USER`` (the grader is   ``ddplab.grade.unprivileged``
                    root: Gradescope's container)
``Plain``           no sandbox, no ``--run-as``: the worker has    here
                    the grader's rights, and the grader says so
==================  =============================================  ==========================

Each implementation answers the same questions: the worker's working folder
(``folder``), the process to start (``worker``, a ``procs.Group`` not yet
started, with its command, environment and user), the signal that ended it
(``signal_of``), what the grader says once as it starts (``notice``), whether
the class may share one engine template (``shares_template``) and how long
to wait for what the worker's end hands to the grader (``settle``). What
differs between them is only here and in their modules; ``class_run`` runs
every worker the same way.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from pathlib import Path

from .. import procs

#: Environment variables a worker without the grader's rights gets (names, or prefixes ending in
#: _): what Python, Jupyter and torch need.
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ", "PYTHONPATH", "PYTHONHASHSEED",
            "LC_", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "GLOO_", "DDPLAB_", "NCCL_", "CUDA_")
#: Set by the grader so that a submission's kernel borrows no process from outside.
DROP_ENV = ("DDPLAB_TEMPLATE",)


def environment(env: dict) -> dict:
    """The variables a worker without the grader's rights gets: what Python, Jupyter and torch need."""
    return {k: v for k, v in env.items()
            if k not in DROP_ENV and any(k == keep or (keep.endswith("_") and k.startswith(keep))
                                         for keep in KEEP_ENV)}


def worker_group(command: list[str], env: dict, **how) -> procs.Group:
    """The one process of a worker, as every ``Isolation`` starts it (``how``: ``user``, ``cwd``).

    In our session, not one of its own: a terminal's Ctrl-C reaches the worker
    too, and it stops (a worker in a session of its own would go on grading
    while the pool waits for it). Its stdout is discarded; its last stderr line
    is the message. Not noting its descendants while it runs keeps a long
    grading from reading the process table ten times a second; at the end,
    those it still has are ended with it.
    """
    return procs.Group([command], env=env, output="stderr", session=False, note=False, **how)


class Isolation(ABC):
    """How one grading run starts its workers; see the module docstring for the three kinds."""

    #: Whether the engines of this worker's labs may be forked from one template the grader
    #: starts for the class: only where the worker sees what the grader sees, with its rights.
    shares_template = False
    #: Seconds the grader waits, after a worker ended, for the processes its end hands to the
    #: grader (``procs.reap_adopted``): bubblewrap's own child comes a moment after.
    settle = 0.0

    @abstractmethod
    def notice(self) -> str:
        """What ``ddplab grade`` says once as it starts ("" where the workers are sandboxed)."""

    def folder(self, work: Path, submission: Path, text: str) -> Path:
        """The worker's working folder, its kernel's: by default a copy of the notebook (``text``)
        in ``work/work``, the one folder it may write to."""
        cwd = work / "work"
        cwd.mkdir()
        (cwd / submission.name).write_text(text, encoding="utf-8")
        return cwd

    @abstractmethod
    def worker(self, command: list[str], work: Path, env: dict) -> procs.Group:
        """The worker, not started: ``command`` run here, its files in ``work`` (removed by the
        grader however it ends), ``env`` the environment the grader would give it."""

    def signal_of(self, returncode: int | None) -> int | None:
        """The number of the signal that ended the worker, from its exit status; None if it
        exited by itself."""
        return -returncode if returncode is not None and returncode < 0 else None


class Plain(Isolation):
    """No sandbox and no other user: the worker runs with the grader's rights, in the
    submission's own folder (``why``: why there is no sandbox)."""

    shares_template = True

    def __init__(self, why: str) -> None:
        self.why = why

    def notice(self) -> str:
        return (f"ddplab grade: grading WITHOUT a sandbox ({self.why}): submissions run with your "
                f"rights and can read your files and find this process.")

    def folder(self, work: Path, submission: Path, text: str) -> Path:
        # The submission's own folder is the working directory, as in nbgrader:
        # files a notebook writes land beside it, never in the course's folder.
        return submission.resolve().parent

    def worker(self, command: list[str], work: Path, env: dict) -> procs.Group:
        # Its temporary files go in the work folder, removed however it ends (a
        # sandbox's /tmp is a tmpfs of its own): a notebook stopped mid-way leaves
        # nothing in the machine's temporary folder.
        (work / "tmp").mkdir()
        return worker_group(command, dict(env, TMPDIR=str(work / "tmp")))


def killed_reason(returncode: int | None, isolated: Isolation) -> str:
    """The reason for a grading worker that a signal ended ("" if it exited by itself, or a
    terminal's Ctrl-C, SIGINT, reached it: the grader stops then too); ``isolated`` reads
    the signal from the exit status (``Isolation.signal_of``).

    Not the worker's last stderr line: it had no chance to say anything, and that line is
    whatever its kernel logged last (a start-up warning), which reads as the cause. Its
    own kernel's code is what reaches it (a submission that kills its ancestors); the
    grader ends a worker only at the deadline, reported apart.
    """
    number = isolated.signal_of(returncode)
    if number is None or number == signal.SIGINT:
        return ""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return (f"not graded: the submission killed its grader: the grading worker that runs its "
            f"kernel was ended by {name} while the notebook ran, which a notebook does when its "
            f"code signals its kernel's parent processes (os.getppid()) or others it did not "
            f"start. Such code cannot be graded. (If the notebook does no such thing, the machine "
            f"ran out of memory: see dmesg.)")
