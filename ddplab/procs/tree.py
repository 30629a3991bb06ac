"""Starting one process, and ending a tree of them: ``start``, ``Tree``, ``end_tree``.

``run_command`` runs a short command to its end (``subprocess.run``).
``reap_adopted`` reaps the zombies a child subreaper adopted.

Every process ddplab starts (a lab's controller and engines, a launch's
torchrun, a training run, a grading worker or kernel) is ended here, by one
policy, ``Tree.end``:

1. Find the whole tree first. Each member is frozen (SIGSTOP) before its
   children are listed, so none can start a process we do not see.
2. Send SIGTERM to every member, children before parents, then let them run
   again (SIGCONT) so they can act on it.
3. Wait up to ``grace`` seconds for them to exit (``grace=0``: do not wait;
   an engine stuck in a C++ collective never acts on SIGTERM anyway).
4. SIGKILL what is left, and anything it started meanwhile.
5. Wait until every member is gone (a zombie counts as gone: our own
   children are left for their ``Popen`` to reap, which records the exit code).

Members are ``psutil.Process`` objects, taken while the process was known to
be the one we mean; psutil compares its start time before every signal, so a
pid the OS has since given to another process is never signalled. A tree can
also hold whole sessions (``sessions=True``, ``add_session``): what a process
started with ``start`` left in its session is found even after its parent died.
"""

from __future__ import annotations

import os
import signal as _signal
import subprocess
import threading
import time
import weakref
from typing import Iterable, Union

import psutil

Member = Union[int, psutil.Process, subprocess.Popen]
#: How long ``end`` waits for SIGKILLed processes to disappear.
KILL_WAIT_S = 10.0
#: How long a supervised group's processes get to act on SIGTERM before they are
#: killed: torchrun, told to stop, ends its workers itself and says why.
END_GRACE_S = 3.0
#: A job made progress over a window when its processes used at least this share of one core
#: in it (``cpu_used`` over the window's seconds): a rank waiting in gloo uses about 0.005, one
#: computing up to 1, and still about 0.3 on two cores shared by six busy processes.
BUSY_SHARE = 0.1


def process(member: Member) -> psutil.Process | None:
    """A psutil handle for a pid, a Popen or a handle; None if it is gone already."""
    if isinstance(member, psutil.Process):
        return member
    pid = member.pid if isinstance(member, subprocess.Popen) else int(member)
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def alive(member: Member | None) -> bool:
    """Whether the process still runs: it exists, is the same process, and is not a zombie."""
    handle = process(member) if member is not None else None
    try:
        return handle is not None and handle.is_running() and \
            handle.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def descendants(member: Member) -> list[psutil.Process]:
    """Every live descendant of a process (empty if it is gone)."""
    handle = process(member)
    try:
        return handle.children(recursive=True) if handle is not None else []
    except psutil.Error:
        return []


def cpu_times(members: Iterable[Member]) -> dict[int, float]:
    """The CPU time (user and system, in seconds) each live process among ``members`` used so
    far, by pid, with that of the children it has waited for (torchrun's agent reaps its
    workers: what a worker used before it ended is its agent's then, not lost).

    What tells a long job from a stuck one: a process computing, or moving a collective's data,
    uses a core; one waiting in gloo for another rank uses about 0.5% of one.
    """
    times: dict[int, float] = {}
    for member in members:
        handle = process(member)
        if handle is None or handle.pid in times:
            continue
        try:
            used = handle.cpu_times()
            times[handle.pid] = used.user + used.system + used.children_user + used.children_system
        except psutil.Error:
            pass                  # gone since: what it used is no longer anyone's to read
    return times


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """The CPU seconds used between two ``cpu_times`` readings, by the processes alive at the
    second (a process started meanwhile counts whole; one that ended meanwhile is not counted)."""
    return sum(max(0.0, used - before.get(pid, 0.0)) for pid, used in after.items())


def send(member: Member, sig: int) -> bool:
    """Send ``sig`` to one process if it is still the same process; whether it was sent."""
    handle = process(member)
    try:
        if handle is None:
            return False
        handle.send_signal(sig)
        return True
    except psutil.Error:
        return False


def start(command: list[str], *, session: bool = True, **popen_kwargs) -> subprocess.Popen:
    """Start ``command``; the only ``Popen`` in ddplab (``tools/check_layout.py`` holds to it).

    ``session=True``: in a session of its own, so the kernel's Ctrl-C and
    process group are not its, and ``Tree(sessions=True)`` finds whatever it
    leaves behind. ``session=False`` keeps it in ours: a terminal's Ctrl-C
    reaches it too (``ddplab grade``'s workers). Its stdin is /dev/null unless given.
    """
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    proc = subprocess.Popen(command, start_new_session=session, **popen_kwargs)
    _started.add(proc)
    return proc


def run_command(command: list[str], *, timeout: float, **options) -> subprocess.CompletedProcess:
    """Run one short command to its end; what ``subprocess.run(command, timeout=timeout,
    **options)`` returns and raises (the only ``subprocess.run`` in ddplab).

    For a probe such as ``ssh -G``, ``squeue`` or ``mpiexec --version``: at
    ``timeout`` the command is killed and ``subprocess.TimeoutExpired`` raised;
    a command that cannot start raises ``OSError``. A command that runs on, or
    has children of its own to end, is started with ``start`` or a ``Group``.
    """
    with _running_commands_lock:
        _running_commands[0] += 1
    try:
        return subprocess.run(command, timeout=timeout, **options)
    finally:
        with _running_commands_lock:
            _running_commands[0] -= 1


#: Every child ``start`` made: ``reap_adopted`` leaves them to their ``Popen``.
_started: weakref.WeakSet = weakref.WeakSet()
#: ``run_command``s under way (their children are ``subprocess.run``'s to reap).
_running_commands, _running_commands_lock = [0], threading.Lock()


def reap_adopted(settle: float = 0.0) -> list[int]:
    """Reap this process's zombie children that no ``Popen`` of ours will: orphans a child
    subreaper adopted. Returns their pids. While a ``run_command`` runs, it waits: that
    command's child is ``subprocess.run``'s, and reaping it here would lose its exit status.

    ``settle``: also wait up to that many seconds for adopted children still running to
    exit, and reap them. A sandbox leaves one such child as it ends: the outer ``bwrap``
    exits as soon as it learns its command's exit status, without waiting for its own child
    (the sandbox's pid 1), which dies a moment later and is handed to the nearest subreaper.
    """
    deadline = time.monotonic() + settle
    reaped: list[int] = []
    while True:
        running = _reap_adopted_once(reaped)
        if not running or time.monotonic() >= deadline:
            return reaped
        time.sleep(0.01)


def _reap_adopted_once(reaped: list[int]) -> int:
    """Reap the adopted zombies now (appending to ``reaped``); how many adopted children still run."""
    running = 0
    with _running_commands_lock:
        if _running_commands[0]:
            return 0
        ours = {p.pid for p in list(_started) if p.returncode is None}
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return 0
        for child in children:
            try:
                if child.pid in ours:
                    continue
                if child.status() != psutil.STATUS_ZOMBIE:
                    running += 1
                elif os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                    reaped.append(child.pid)
            except (psutil.Error, ChildProcessError):
                continue
    return running


class Tree:
    """Processes to end together: some roots, and every descendant noted while they ran.

    A process whose parent exits is handed to init and no longer shows up as
    anyone's descendant, so callers that wait on long-running trees call
    ``note()`` now and then; ``end()`` then reaches those orphans too. With
    ``sessions=True`` the roots were started by ``start`` (each leads a session
    of its own), and every process still in one of those sessions is a member.
    """

    def __init__(self, roots: Iterable[Member] = (), *, sessions: bool = False) -> None:
        self.members: list[psutil.Process] = []
        self._sessions: set[int] = set()
        for root in roots:
            self.add(root, session=sessions)

    def add(self, member: Member, *, session: bool = False) -> psutil.Process | None:
        """Make a process a member (never this process itself); its handle, or None if gone.

        ``session``: it leads a session (``start`` started it), and every
        process left in that session is a member too.
        """
        handle = process(member)
        if handle is not None and session:
            self._sessions.add(handle.pid)
        if handle is not None and handle.pid != os.getpid() and handle not in self.members:
            self.members.append(handle)
        return handle

    def add_session(self, session_id: int) -> None:
        """Every process in session ``session_id`` is a member, even once its leader is gone.

        Linux never gives a new process a pid that is still some session's
        id, so a session id, unlike a bare pid, cannot name a stranger.
        """
        self._sessions.add(int(session_id))

    def note(self) -> None:
        """Add every live descendant of every member."""
        for member in list(self.members):
            for child in descendants(member):
                self.add(child)

    def alive(self) -> list[psutil.Process]:
        return [m for m in self.members if alive(m)]

    def _freeze(self) -> list[psutil.Process]:
        """Stop every member and each descendant found meanwhile; return them, deepest first."""
        for pid in psutil.pids() if self._sessions else ():
            try:
                if os.getsid(pid) in self._sessions:
                    self.add(pid)
            except OSError:
                pass
        depth: dict[psutil.Process, int] = {}
        todo = [(m, 0) for m in self.members]
        while todo:
            handle, level = todo.pop()
            if depth.get(handle, -1) >= level:
                continue
            depth[handle] = level
            self.add(handle)
            try:
                handle.suspend()
                todo += [(child, level + 1) for child in handle.children()]
            except psutil.Error:
                pass
        return sorted(depth, key=lambda h: -depth[h])

    def end(self, grace: float = 5.0) -> list[psutil.Process]:
        """End every member by this module's policy; return any still running (normally none).

        Zombies count as gone: a member that is our own child is left for its
        ``Popen`` to reap, so that its exit code is recorded there.
        """
        ordered = self._freeze()
        for handle in ordered:                       # children first
            send(handle, _signal.SIGTERM)
        for handle in ordered:
            send(handle, _signal.SIGCONT)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            self.note()              # a process may start another while it shuts down
            time.sleep(0.02)
        if self.alive():
            self._freeze()           # freeze again: nothing started meanwhile escapes
            for handle in self.alive():
                send(handle, _signal.SIGKILL)
        # SIGKILL is delivered when the process next runs; on a busy machine
        # that is not at once. Return only when every one is gone.
        deadline = time.monotonic() + KILL_WAIT_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.alive()


def end_tree(*roots: Member, grace: float = 5.0) -> list[psutil.Process]:
    """End ``roots`` and all their descendants (``Tree.end``); return survivors (normally none)."""
    tree = Tree(roots)
    tree.note()
    return tree.end(grace)
