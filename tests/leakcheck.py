"""The suite's leak check: nothing a test, a module or a notebook starts outlives it (issue 47).

``install(config)`` (each conftest calls it; it acts once per pytest process):

1. gives this pytest process a temporary folder of its own (``TMPDIR`` and
   ``tempfile.tempdir``, inherited by every lab, engine, kernel and subprocess
   it starts), removed when pytest exits. So a ``ddplab-*`` entry there is
   the suite's, never another user's lab on the same machine. Its path is
   short (``/tmp/ddplab-suite-XXXXXXXX``): the labs' AF_UNIX sockets in it stay
   far below the 108-byte limit. Its mode is 0711, as /tmp lets others pass: a lab's
   own modes keep other users out, as they must outside the suite.
2. fails the teardown of every test (a ``pytest.Function``), and of every
   module, class or notebook when it ends, that leaves behind a new ``ddplab-*``
   entry in that folder or a live process of this pytest's tree, naming the
   test and what it left; then removes and ends what it found, so one leak is
   reported once.

Per test, because a per-test report names the culprit; per module too, because
a module-scoped fixture is only torn down with its module's last test; per
notebook (nbval's cells share one kernel, so a notebook is checked as a whole).
What a live fixture wider than a test owns is not a leak while it lives:
whatever its set-up made (``ddplab-*`` entries and processes, and their
descendants), and, for a ``ddplab.Lab`` it holds, the lab's directory, ranks,
controller and the engines' template, even after a restart made them anew. A
folder named on the command line of such a process (the template's, the
controller's) is its owner's too. Leftovers get ``SETTLE_S`` to go: a killed
kernel's labs are cleaned up by their guards within a second.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile
import time
from typing import Any

import psutil
import pytest

PREFIX = "ddplab-"
#: Seconds a leftover may take to go (a tether polls its kernel every 0.5 s) before it is a leak.
SETTLE_S = 15.0

_own_tmpdir = ""
#: Each live non-function fixture: (its value, the entries and pids its set-up made).
_owners: dict[Any, tuple[Any, set[str], set[int]]] = {}
#: Each started node (test, class, module, notebook, session): (entries, pids) when it began.
_began: dict[Any, tuple[set[str], set[int]]] = {}


def lab_dirs() -> set[str]:
    """The ``ddplab-*`` entries now in the temporary folder (labs, templates, checks' folders)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")))


def my_process_tree() -> set[int]:
    """Pids of every live process this test process started, directly or not."""
    found = set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def use_own_tmpdir() -> str:
    """Give this process and its children a temporary folder of their own (made once)."""
    global _own_tmpdir
    if not _own_tmpdir:
        _own_tmpdir = tempfile.mkdtemp(prefix=PREFIX + "suite-")
        # Others may pass through (not list), as through /tmp: what keeps another user
        # out of a lab must be the lab's own modes (tests/test_private_store.py), not ours.
        os.chmod(_own_tmpdir, 0o711)
        # At exit, after the exit handlers registered since (IPython's writes its
        # history database, which may live here), not at pytest's unconfigure.
        atexit.register(shutil.rmtree, _own_tmpdir, ignore_errors=True)
        os.environ["TMPDIR"] = tempfile.tempdir = _own_tmpdir
    return _own_tmpdir


class _Plugin:
    """The hooks; registered once, whichever conftest installs it first."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function":
            return (yield)
        dirs, pids = lab_dirs(), my_process_tree()
        value = yield
        _owners[fixturedef] = (value, lab_dirs() - dirs, my_process_tree() - pids)
        return value

    def pytest_fixture_post_finalizer(self, fixturedef, request):
        _owners.pop(fixturedef, None)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        now = (lab_dirs(), my_process_tree())
        for node in item.listchain():
            _began.setdefault(node, now)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        failed = None
        try:
            result = yield
        except BaseException as e:      # the teardown's own failure comes first
            failed = e
        staying = set(nextitem.listchain()) if nextitem is not None else set()
        found = []
        for node in reversed(item.listchain()):          # the test first, then its module...
            if node in staying:
                break
            began = _began.pop(node, None)
            # nbval's cells share the notebook's kernel: the notebook is what is checked.
            if began is None or (node is item and not isinstance(item, pytest.Function)):
                continue
            dirs, pids = left_behind(began)
            if dirs or pids:
                found.append(describe(node, dirs, pids))
                _clear(dirs, pids)
        if failed is not None:
            raise failed
        if found:
            pytest.fail("\n".join(found), pytrace=False)
        return result


def install(config: pytest.Config) -> None:
    """Use a temporary folder of the suite's own and check every test against it (once)."""
    use_own_tmpdir()
    if not config.pluginmanager.has_plugin("ddplab-leakcheck"):
        config.pluginmanager.register(_Plugin(), "ddplab-leakcheck")


def _labs_in(value: Any) -> list:
    from ddplab.lab import Lab
    if isinstance(value, Lab):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Lab)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, Lab)]
    return []


def _owned() -> tuple[set[str], set[int]]:
    """What the live wider-than-a-test fixtures own now (see the module's docstring)."""
    dirs, roots = set(), set()
    for value, made_dirs, made_pids in _owners.values():
        dirs |= made_dirs
        roots |= made_pids
        for lab in _labs_in(value):
            if not lab.running:
                continue
            dirs.add(lab.directory)
            # Engines on hosts keep a folder per rank, made by the engine (``rank_directory``),
            # and a lab.restart() during a test makes new ones: the lab's, not the test's.
            directory_of = getattr(lab.engines, "rank_directory", None)
            for rank in lab.ranks if directory_of is not None else ():
                try:
                    dirs.add(directory_of(rank))
                except (KeyError, IndexError):      # an engine not described (yet, or any more)
                    continue
            ranks = [pid for pid in lab.pids if psutil.pid_exists(pid)]
            roots |= {*ranks, *filter(None, [lab.controller_pid])}
            # Engines on hosts: the ssh sessions or mpiexec's watcher that hold them, which a
            # lab.restart() during a test replaces.
            roots |= set(getattr(lab.engines, "local_pids", ()))
            for pid in ranks:             # an engine's parent: the template that forked it
                try:
                    parent = psutil.Process(pid).ppid()
                except psutil.NoSuchProcess:
                    continue
                if parent != os.getpid():
                    roots.add(parent)
    pids = set(roots)
    for pid in roots:
        try:
            pids |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    entries = lab_dirs()
    for pid in pids:
        try:
            words = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        dirs |= {entry for entry in entries if entry in words}
    return dirs, pids


def _process_wide(pid: int) -> bool:
    """A helper Python keeps for the whole process once started: multiprocessing's resource
    tracker (``mp.spawn`` starts it, Python ends it at exit), not something a test left."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def left_behind(began: tuple[set[str], set[int]]) -> tuple[set, set]:
    """The entries and processes new since ``began`` that no live fixture owns, after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        dirs = lab_dirs() - began[0]
        pids = {pid for pid in my_process_tree() - began[1] if not _process_wide(pid)}
        if dirs or pids:
            owned_dirs, owned_pids = _owned()
            dirs, pids = dirs - owned_dirs, pids - owned_pids
        if not (dirs or pids) or time.monotonic() > deadline:
            return dirs, pids
        time.sleep(0.2)


def describe(node: Any, dirs: set[str], pids: set[int]) -> str:
    """One message: which test (module, notebook) left what, in which folder."""
    what = [f"{os.path.basename(d)}" for d in sorted(dirs)]
    for pid in sorted(pids):
        try:
            what.append(f"process {pid} ({' '.join(psutil.Process(pid).cmdline())[:120]})")
        except psutil.Error:
            what.append(f"process {pid}")
    return (f"ddplab leak check: {node.nodeid or 'the session'} left behind, in "
            f"{tempfile.gettempdir()} and this pytest's process tree: " + "; ".join(what) +
            ". Remove what a test makes when it ends (try/finally, a context manager, or the "
            "lab's own directory) and end what it starts.")


def _clear(dirs: set[str], pids: set[int]) -> None:
    """Remove and end what a leak left, so it is reported once and later tests start clean."""
    from ddplab import procs
    for d in dirs:
        if os.path.isdir(d) and not os.path.islink(d):
            shutil.rmtree(d, ignore_errors=True)
        else:
            try:
                os.remove(d)
            except OSError:
                pass
    procs.end_tree(*[p for p in pids if psutil.pid_exists(p)], grace=1)
