"""Engines forked from a warm template, through ipyparallel's launcher extension point.

ipyparallel starts each engine with a launcher class; ``LocalEngineSetLauncher``
starts a new process per engine, and every engine then imports torch on its own.
``ForkedEngineSetLauncher`` is the same launcher with one change: it asks the
kernel's template process (``ddplab.rank.template``), which imported torch once,
to fork the engine instead. Everything else (the command line, the environment,
the log file, how ipyparallel watches and stops the engine) is ipyparallel's.

One template serves every lab and restart of a kernel; it starts with the first
lab, so that lab pays one import of torch instead of one per rank, and a
restart pays none. ``lab.stop()`` ends it; so does the kernel's exit, even by
``kill -9`` (it polls its parent).

Set ``DDPLAB_FORK=0`` to start engines as plain processes instead (the template
needs ``fork``, so it is only used on Linux).

``ddplab grade`` runs a whole class's submissions, each in a kernel of its own.
It starts one template for all of them and names its socket in
``DDPLAB_TEMPLATE``; a kernel that finds it there borrows that template
(``BorrowedTemplate``) instead of importing torch again. Each fork request says
which kernel asked (``owner``), and the template ends that kernel's engines and
removes its labs' directories when the kernel dies, as a kernel's own template
does. Nothing a kernel runs reaches the template: it only ever forks
``ddplab.rank.tether`` children, each a fresh copy of a process that never ran
a submission's code. If that template dies mid-class, the next kernels find
its socket unanswered and start templates of their own: slower, same grades.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import tempfile

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

from .. import procs
from ..errors import DdplabError

READY_TIMEOUT_S = 120
SOCKET_NAME = "fork.sock"
#: The socket of a template to borrow (``ddplab grade`` sets it for the kernels it runs).
BORROW_ENV = "DDPLAB_TEMPLATE"


def enabled() -> bool:
    """Whether labs fork their engines from the template (Linux, unless DDPLAB_FORK=0)."""
    return sys.platform.startswith("linux") and os.environ.get("DDPLAB_FORK", "1") != "0"


class Template:
    """The template process of this kernel: forks engines on request."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ddplab-template-")    # mode 0700
        self.socket_path = os.path.join(self.directory, SOCKET_NAME)
        env = dict(os.environ, DDPLAB_PARENT_PID=str(os.getpid()))
        env.pop(BORROW_ENV, None)
        # A group of one, in a session of its own: Kernel > Interrupt must not
        # reach it. Its stdout says "ready"; its stderr stays the kernel's, so a
        # template that breaks shows why in the kernel's log.
        self._group = procs.Group([[sys.executable, "-m", "ddplab.rank.template",
                                    self.socket_path]], env=env, output="stdout").start()
        self.process = self._group.processes[0]
        self._ready = False
        self._network: str | None = None

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> None:
        if self._ready:
            return
        # The template prints "ready" once torch is imported and it listens.
        if not self._group.wait_for_line(0, "ready"):
            self.stop()
            raise DdplabError("ddplab: the engine template process could not start "
                              f"(it exited with {self.process.poll()}). Set DDPLAB_FORK=0 to "
                              "start engines as plain processes, and report this.")
        self._ready = True

    def _ask(self, request: dict) -> dict:
        self.wait_ready()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(READY_TIMEOUT_S)
            conn.connect(self.socket_path)
            with conn.makefile("rwb") as stream:
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                return json.loads(stream.readline())

    def fork(self, argv: list[str], env: dict, cwd: str, output: str, lab_dir: str = "") -> int:
        """Fork a child that runs ``argv`` (a ``python -m ddplab.rank.tether ...`` line); its pid.

        ``lab_dir``: the lab's directory, which the template removes if the kernel dies.
        """
        return int(self._ask({"argv": argv, "env": env, "cwd": cwd, "output": output,
                              "lab_dir": lab_dir, "owner": os.getpid()})["pid"])

    def network_shared_because(self) -> str:
        """Why the engines it forks share the machine's network; "" if they have their own."""
        if self._network is None:
            self._network = str(self._ask({"network": 1}).get("shared_because", "it is too old"))
        return self._network

    def ended(self, pid: int) -> dict:
        """How child ``pid`` ended: ``{"exit": code}``, ``{"signal": n}``, or ``{}`` if unknown."""
        if not self.alive:
            return {}
        try:
            return self._ask({"status": pid})
        except OSError:
            return {}

    def stop(self) -> None:
        """End the template; it ends whatever children it still has."""
        self._group.close(grace=5)
        # The template removes its directory as it exits; a SIGKILLed one cannot.
        import shutil
        shutil.rmtree(self.directory, ignore_errors=True)


class BorrowedTemplate(Template):
    """A template another process started and will end: ``ddplab grade``'s, shared by its kernels.

    It watches this kernel: when the kernel dies it ends the engines it forked
    for it, so borrowing changes nothing about what outlives a kernel.
    """

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._ready = True                   # its owner waited for "ready" before naming it
        self._network = None

    @property
    def alive(self) -> bool:
        # A killed template leaves its socket file behind: ask whether anyone
        # listens on it (a refused connect costs microseconds).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            try:
                probe.connect(self.socket_path)
            except OSError:
                return False
        return True

    def stop(self) -> None:
        """Nothing to do: not ours to end (our engines end with our labs, or with this kernel)."""


def _borrowed() -> BorrowedTemplate | None:
    """The template ``DDPLAB_TEMPLATE`` names, if it still answers.

    If it died (a grading run's template, killed mid-class), this kernel starts
    a template of its own: the same engines, one import of torch slower.
    """
    path = os.environ.get(BORROW_ENV)
    if not path:
        return None
    borrowed = BorrowedTemplate(path)
    return borrowed if borrowed.alive else None


_template: Template | None = None


def shared() -> Template:
    """This kernel's template, started on first use (and again if it died); or the one it borrows."""
    global _template
    if _template is None or not _template.alive:
        borrowed = _borrowed()
        if borrowed is not None:
            _template = borrowed
            return _template
        if _template is not None:
            _template.stop()
        _template = Template()
        atexit.register(stop)
    return _template


def warm() -> None:
    """Start the template now, so torch imports while the controller starts."""
    if enabled():
        shared()


_users: set[int] = set()     # id() of the running labs whose engines the template forked


def use(lab: object) -> None:
    """Note that ``lab`` runs engines forked from the template."""
    _users.add(id(lab))


def release(lab: object) -> None:
    """``lab`` stopped; end the template if no running lab uses it any more."""
    _users.discard(id(lab))


def stop_if_unused() -> None:
    """End the template unless a running lab still has engines forked from it."""
    if not _users:
        stop()


def stop() -> None:
    """End this kernel's template, if it runs (the next lab starts a new one)."""
    global _template
    if _template is not None:
        _template.stop()
        _template = None
        atexit.unregister(stop)


def network_shared_because() -> str:
    """Why this kernel's engines share the machine's network; "" if they have one of their own.

    Engines forked from the template live in its private network
    (``ddplab.rank.netns``); engines started as plain processes cannot share one.
    """
    if not enabled():
        return "engines start as plain processes (DDPLAB_FORK=0), not from the template"
    return shared().network_shared_because()


def ended(pid: int) -> dict:
    """How an engine the template forked ended (see ``Template.ended``)."""
    return _template.ended(pid) if _template is not None else {}


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine, forked from the template instead of started as a new process."""

    def start(self):
        env = os.environ.copy()
        env.update(self.get_env())
        pid = shared().fork(self.args, env, self.work_dir, self.output_file, self.profile_dir)
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, each engine forked from the template."""

    launcher_class = ForkedEngineLauncher


