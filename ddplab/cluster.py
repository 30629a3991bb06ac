"""The Lab: a torch.distributed process group you drive from a notebook.

Lifecycle
---------
``lab = ddplab.start(world_size=2)`` starts, through ipyparallel's Cluster API,
one controller and one engine process per rank, all on 127.0.0.1. Each engine
gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS) and calls
``init_process_group``: by default through a TCPStore that rank 0 opens on a
port it bound first (race-free); ``start(init_method="env" | "tcp" | "file")``
uses torch's own ``env://``, ``tcp://`` or ``file://`` instead. ddplab numbers the ranks itself, 0..N-1, and every
result and every line of output is keyed and ordered by that rank.

- ``start()`` with the same arguments returns the running lab; with other
  arguments it stops the old lab and starts a new one.
- ``lab.run(fn, ...)`` calls a function on the ranks; ``%%ranks`` and
  ``%%rank N`` run a cell there. Each rank keeps its namespace across cells.
- ``lab.restart()`` replaces every engine (same ranks, fresh processes).
- ``lab.stop()``, or leaving ``with ddplab.start(...) as lab:``, ends every
  process the lab started and removes its files.

Failure modes, and what you see
-------------------------------
- Code raises on a rank: ``RankError`` with that rank's traceback.
- Ranks wait for each other forever (a deadlock): after ``timeout`` seconds,
  ``HangError`` says per rank whether it finished, failed or is still running,
  and where a stuck rank is blocked, e.g. ``rank 0: still in send (cell line 3)``.
  The stuck engines cannot be freed from inside; ``lab.restart()`` recovers.
- A ``%%rank N`` cell that is still running after ``grace`` seconds (a send
  waiting for its recv) returns at once and keeps running on its rank; its
  output appears under the next ddplab cell that finishes, or ``lab.wait()``.
- An engine dies (kill -9, out of memory): the next call raises
  ``EngineDiedError`` naming the rank; ``lab.restart()`` recovers.
- Kernel > Interrupt: the ranks get SIGINT. If they stop, the lab is usable;
  if one is blocked in C++ and cannot stop, the message says to restart.
- The kernel dies, even by kill -9: every engine and the controller notice
  their parent is gone and exit within about a second (``ddplab.guard``).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import diagnose, display, engine, progress
from .env import (check_init_method, check_timeout, check_world_size, choose_backend,
                  free_port, gpu_count, omp_threads, worker_env)
from .errors import ConfigError, DdplabError, EngineDiedError, HangError, RankError

HOST = "127.0.0.1"
_GUARD = [sys.executable, "-m", "ddplab.guard"]
# The hub pings engines on this period and registers an engine only after a
# ping; ipyparallel's 3 s default made start-up twice as slow.
_HEARTBEAT_MS = 300
# After one rank fails, how long the others get to finish before we conclude
# they are waiting for it (in a collective, or a recv) and report the failure.
FAILURE_SETTLE = 1.0
_current: "Lab | None" = None


@dataclass
class _Task:
    """One submission to one rank, and what came back."""
    rank: int
    result: Any                    # ipyparallel AsyncResult
    note: str = ""                 # label suffix when shown late
    outcome: dict | None = field(default=None)


@dataclass(frozen=True)
class LabSpec:
    """The arguments a lab was started with; equal specs share one lab."""
    world_size: int
    backend: str
    timeout: float
    grace: float
    pg_timeout: float
    debug: bool
    init_method: str = "store"     # see start(); a default keeps LabSpec(...) calls short


class Lab:
    """A running group of ranks. Make one with ``ddplab.start``."""

    def __init__(self, spec: LabSpec, gpus: int) -> None:
        self.spec = spec
        self.backend, self.backend_reason = choose_backend(spec.backend, spec.world_size, gpus)
        self._cluster = None
        self._client = None
        self._engine_ids: list[int] = []   # index: torch rank
        self._pids: list[int] = []         # index: torch rank
        self._dir = ""
        self._pending: list[_Task] = []
        self._broken = ""                  # why the lab needs a restart, if it does

    # ---------------------------------------------------------------- lifecycle
    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def ranks(self) -> list[int]:
        """The torch ranks, ``[0, 1, ..., world_size - 1]``."""
        return list(range(self.spec.world_size))

    @property
    def running(self) -> bool:
        return self._cluster is not None

    @property
    def pids(self) -> list[int]:
        """The engine process ids, indexed by rank (for tests and tools, not for output)."""
        return list(self._pids)

    def _launch(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ddplab-")   # mode 0700: only we can read it
        # A script that ends without lab.stop() must not leave files behind;
        # _teardown unregisters this again, so restarts do not pile them up.
        atexit.register(self._teardown)
        n = self.spec.world_size
        try:
            self._cluster = cluster = self._configure_cluster()
            cluster.start_cluster_sync(n=n)
            self._client = cluster.connect_client_sync()
            # interactive=False: ipyparallel's own progress bar is noise in a lesson.
            self._client.wait_for_engines(n, timeout=cluster.engine_timeout, interactive=False)
            self._engine_ids = sorted(self._client.ids)[:n]
            # cloudpickle sends a notebook function with the globals it uses
            # (``dist``, ``torch``, a helper), as a student expects; plain
            # pickling would fail on the ranks with a NameError.
            self._client[self._engine_ids].use_cloudpickle()
            self._join_group()
        except BaseException:
            self._teardown()
            raise
        self._broken = ""

    def _configure_cluster(self):
        """An ipyparallel Cluster (not started) set up for a fast, self-cleaning local lab."""
        import ipyparallel as ipp
        n = self.spec.world_size
        parent = {"DDPLAB_PARENT_PID": str(os.getpid())}
        cluster = ipp.Cluster(
            n=n, profile_dir=self._dir, cluster_id="lab", log_level=logging.ERROR,
            controller_ip=HOST, delay=0, engine_timeout=max(60, int(self.spec.timeout)),
            # Engines start at once and load torch while the controller comes up.
            send_engines_connection_env=False,
            controller_args=[f"--HeartMonitor.period={_HEARTBEAT_MS}"])
        config = cluster.config
        config.LocalControllerLauncher.controller_cmd = _GUARD + ["ipyparallel.controller"]
        config.LocalControllerLauncher.environment = dict(parent, DDPLAB_CLEANUP_DIR=self._dir)
        config.LocalEngineSetLauncher.engine_cmd = _GUARD + ["ipyparallel.engine"]
        config.LocalEngineSetLauncher.engine_args = [
            # No nanny process: ddplab signals engines by pid, so it is not needed.
            "--IPEngine.enable_nanny=False", "--IPEngine.wait_for_url_file=120"]
        config.LocalEngineSetLauncher.delay = 0
        engine_env = dict(parent, DDPLAB_PRELOAD="torch",
                          # Set before torch loads, so its thread pool obeys it.
                          OMP_NUM_THREADS=str(omp_threads(n)),
                          # gloo and nccl otherwise pick the interface the hostname
                          # resolves to, which can face the network: stay on loopback.
                          GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
        if self.spec.debug:
            engine_env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        config.LocalEngineSetLauncher.environment = engine_env
        return cluster

    def _join_group(self) -> None:
        n, timeout = self.spec.world_size, self.spec.timeout
        views = [self._client[eid] for eid in self._engine_ids]
        pid_results = [view.apply_async(engine.pid) for view in views]
        method, url = self.spec.init_method, None
        if method == "store":
            port_result = views[0].apply_async(engine.open_store, HOST, n, self.spec.pg_timeout)
        self._pids = [r.get(timeout) for r in pid_results]
        if method == "store":
            port = port_result.get(timeout)
        elif method in ("env", "tcp"):
            # torch's rank 0 binds this port itself, a moment from now; the
            # "store" default avoids that small race by binding first.
            port = free_port(HOST)
            url = "env://" if method == "env" else f"tcp://{HOST}:{port}"
        else:
            # A fresh file for every group: one left over from an earlier
            # group already holds its keys, and the new group deadlocks.
            url = "file://" + os.path.join(self._dir, "init-file")
        tasks = []
        for rank, view in enumerate(views):
            env = worker_env(rank, n, HOST, port if method != "file" else 0)
            if method == "file":        # nobody listens anywhere: say so by leaving them out
                del env["MASTER_ADDR"], env["MASTER_PORT"]
            args = (rank, n, env, self.backend, self.spec.pg_timeout, self._stack_file(rank),
                    [p for p in sys.path if p], url)
            tasks.append(_Task(rank, view.apply_async(engine.call, engine.join_group, args, {})))
        if self._wait(tasks, timeout) != "done":
            failures = self._replay(tasks)
            if failures:
                raise _rank_error(failures)
            raise self._hang_error(tasks, timeout, "init_process_group")

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._dir, f"stack-rank{rank}.txt")

    def _teardown(self) -> None:
        """End every process this lab started, by pid, and remove its files."""
        cluster, self._cluster = self._cluster, None
        if self._client is not None:
            self._client.close()
            self._client = None
        if cluster is not None:
            engines = [launcher for engine_set in cluster.engines.values()
                       for launcher in engine_set.launchers.values()]
            controller = cluster.controller
            helpers = _children(controller.pid) if controller is not None else []
            # Engines stuck in a C++ collective ignore polite requests, and hold
            # no state worth saving, so they are killed outright. The controller
            # is asked to stop, so that it ends its own scheduler processes.
            for pid in self._pids + [e.pid for e in engines]:
                _kill(pid)
            try:
                cluster.stop_cluster_sync()
            except Exception:
                pass
            for pid in helpers:                 # anything the controller left behind
                _kill(pid)
            for launcher in engines + [controller]:
                process = getattr(launcher, "process", None)
                if process is not None:
                    try:
                        process.wait(5)
                    except Exception:
                        pass
        self._forget()

    def _forget(self) -> None:
        """Drop what a stopped lab held: pending cells, ranks, its directory, its atexit hook."""
        self._pending.clear()
        self._pids, self._engine_ids = [], []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""
        atexit.unregister(self._teardown)

    def stop(self) -> None:
        """End every engine and the controller, and remove the lab's files."""
        global _current
        self._teardown()
        if _current is self:
            _current = None

    def restart(self) -> "Lab":
        """Replace every engine with a fresh one; ranks stay 0..N-1. Returns the lab."""
        self._teardown()
        self._launch()
        return self

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<ddplab.Lab world_size={self.world_size} backend={self.backend!r} {state}>"

    # ------------------------------------------------------------------ running
    def check_ranks(self, ranks: Iterable[int] | int | None, spelled: str | None = None) -> list[int]:
        """The ranks to run on, sorted; ConfigError naming the fix if any is not a rank here.

        ``spelled`` is how the user wrote them (``"%%rank 5"``), for the message.
        """
        if ranks is None:
            return self.ranks
        chosen = [ranks] if isinstance(ranks, int) else list(ranks)
        spelled = spelled or f"ranks={ranks!r}"
        n = self.world_size
        if not chosen:
            raise ConfigError(f"ddplab: {spelled} names no rank. Name at least one of this "
                              f"lab's ranks, 0..{n - 1}.")
        bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < n]
        if bad:
            more = max((r for r in bad if isinstance(r, int) and not isinstance(r, bool)
                        and r >= n), default=None)
            bigger = f"ddplab.start(world_size={more + 1})" if more is not None else \
                "ddplab.start(world_size=...)"
            raise ConfigError(
                f"ddplab: {spelled} names rank {bad[0]!r}, but this lab has ranks 0..{n - 1} "
                f"(world_size={n}). Use one of those, or {bigger} for more.")
        return sorted(set(chosen))

    def _ready(self) -> None:
        if not self.running:
            raise DdplabError("ddplab: this lab is stopped. Start one with "
                              "lab = ddplab.start(...) or call lab.restart().")
        if self._broken:
            raise DdplabError(f"ddplab: {self._broken} Recover with: lab.restart()")
        self._check_alive()

    def _check_alive(self) -> None:
        dead = [rank for rank, pid in enumerate(self._pids) if not _alive(pid)]
        if dead:
            self._broken = (f"the engine of rank{'s' if len(dead) > 1 else ''} "
                            f"{', '.join(map(str, dead))} died (killed, or out of memory).")
            raise EngineDiedError(f"ddplab: {self._broken} Recover with: lab.restart()", dead)

    def _submit(self, ranks: list[int], fn: Callable, *args: Any) -> list[_Task]:
        return [_Task(rank, self._client[self._engine_ids[rank]].apply_async(fn, *args))
                for rank in ranks]

    def run(self, fn: Callable, *args: Any, ranks: Iterable[int] | None = None,
            timeout: float | None = None, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` on every rank (or on ``ranks``) and return the results.

        Returns a list indexed by rank; with ``ranks=`` given, a dict keyed by rank.
        What the ranks print is shown afterwards, grouped by rank, in rank order.
        Raises ``RankError`` if any rank raised, ``HangError`` after ``timeout``.
        """
        if not callable(fn):
            raise ConfigError(f"ddplab: lab.run needs a function to call on the ranks, but got "
                              f"{fn!r} ({type(fn).__name__}). Use lab.run(my_function, *args).")
        chosen = self.check_ranks(ranks)
        timeout = self.spec.timeout if timeout is None else check_timeout(timeout)
        self._ready()
        tasks = self._submit(chosen, engine.call, fn, args, kwargs)
        self._finish(tasks, timeout, grace=None)
        values = {task.rank: task.outcome["value"] for task in tasks}
        return [values[r] for r in self.ranks] if ranks is None else values

    def run_cell(self, source: str, ranks: Iterable[int] | None = None,
                 timeout: float | None = None, grace: float | None = None) -> None:
        """Run notebook-cell source on ranks; what ``%%ranks`` and ``%%rank`` call.

        With ``grace``, return once that many seconds pass with ranks still
        running, leaving them running (the two-prompt style).
        """
        chosen = self.check_ranks(ranks)
        timeout = self.spec.timeout if timeout is None else check_timeout(timeout)
        grace = None if grace is None else check_timeout(grace, "grace", example=2)
        self._ready()
        self._finish(self._submit(chosen, engine.run_cell, source), timeout, grace)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for cells still running from earlier ``%%rank`` cells and show their output."""
        timeout = self.spec.timeout if timeout is None else check_timeout(timeout)
        self._ready()
        self._finish([], timeout, grace=None)

    def _finish(self, tasks: list[_Task], timeout: float, grace: float | None) -> None:
        """Wait for ``tasks`` and earlier pending tasks, show output, raise on failure."""
        pending, self._pending = self._pending, []
        everything = pending + tasks
        state = self._wait(everything, timeout if grace is None else grace)
        if state == "timeout" and grace is None:
            self._replay(everything)
            raise self._hang_error(everything, timeout, "cell")
        failures = self._replay(everything)
        still = [t for t in everything if t.outcome is None]
        if failures and still:
            # A rank failed while others wait for it in a collective: they
            # would wait until the group's timeout, so report it now.
            raise self._stuck_after_failure(failures, still)
        for task in still:
            task.note = "(the earlier cell that was still running)"
        self._pending = still
        if still:
            ranks = ", ".join(str(t.rank) for t in still)
            display.say(
                f"ddplab: rank {ranks} is still running this cell, probably waiting for another "
                f"rank (a send waits for its recv). It keeps running; run the matching cell on "
                f"the other rank. Its output appears when a later ddplab cell finishes, "
                f"or call lab.wait().")
        if failures:
            raise _rank_error(failures)

    @staticmethod
    def _replay(tasks: list[_Task]) -> dict[int, str]:
        """Show finished tasks' output in rank order; return their failures by rank."""
        failures: dict[int, str] = {}
        for task in sorted((t for t in tasks if t.outcome is not None), key=lambda t: t.rank):
            display.replay(task.rank, task.outcome["events"], task.note)
            if not task.outcome["ok"]:
                failures[task.rank] = task.outcome["error"]
        return failures

    def _wait(self, tasks: list[_Task], timeout: float) -> str:
        """Wait for ``tasks``; return ``"done"``, ``"failed"`` or ``"timeout"``.

        ``"failed"``: a rank failed and the others have not finished for
        ``FAILURE_SETTLE`` seconds, so they are most likely waiting for it.
        """
        deadline = time.monotonic() + timeout
        failed_at = None
        board = progress.Board()                 # live bars, once a rank calls progress.report
        try:
            while True:
                for task in tasks:
                    if task.outcome is None and task.result.ready():
                        task.outcome = task.result.get()
                board.update({t.rank: t.result for t in tasks})
                undone = [t for t in tasks if t.outcome is None]
                if not undone:
                    return "done"
                now = time.monotonic()
                if failed_at is None and any(not t.outcome["ok"] for t in tasks if t.outcome):
                    failed_at = now
                if failed_at is not None and now - failed_at >= FAILURE_SETTLE:
                    return "failed"
                if now >= deadline:
                    return "timeout"
                if not undone[0].result.wait(min(0.2, deadline - now)):
                    self._check_alive()          # no news for a while: is someone dead?
        except KeyboardInterrupt:
            self._interrupt(tasks)
            raise

    def _interrupt(self, tasks: list[_Task]) -> None:
        """Kernel > Interrupt: pass SIGINT on to the ranks still running."""
        running = [t for t in tasks if not t.result.ready()]
        for task in running:
            _kill(self._pids[task.rank], signal.SIGINT)
        deadline = time.monotonic() + 3
        for task in running:
            while not task.result.ready() and time.monotonic() < deadline:
                task.result.wait(0.1)
        stuck = [t.rank for t in running if not t.result.ready()]
        self._pending = []
        if stuck:
            self._broken = (f"rank {', '.join(map(str, stuck))} did not stop on interrupt "
                            f"(blocked inside a torch.distributed call).")
            display.say(f"ddplab: interrupted; {self._broken} Recover with: lab.restart()")
        else:
            display.say("ddplab: interrupted; the ranks stopped and the lab is usable.")

    def _stuck_after_failure(self, failures: dict[int, str], still: list[_Task]) -> RankError:
        where = self._locate(still, time.monotonic() + 4)[0]
        self._broken = "ranks are stuck waiting for a rank that failed."
        error = _rank_error(failures)
        lines = [str(error), "Meanwhile:"]
        lines += [f"  rank {rank}: still {where[rank]}, waiting for the failed rank"
                  for rank in sorted(where)]
        lines.append("Those ranks cannot be freed from inside. Recover with: lab.restart()")
        return RankError("\n".join(lines), failures)

    def _locate(self, tasks: list[_Task], deadline: float) -> tuple[dict, dict]:
        """For each running task's rank: a one-line location and a short stack."""
        where, stacks = {}, {}
        for task in sorted(tasks, key=lambda t: t.rank):
            dump = diagnose.dump_stack(self._pids[task.rank], self._stack_file(task.rank),
                                       deadline)
            frames = diagnose.main_thread_stack(dump)
            where[task.rank] = diagnose.where(frames)
            stacks[task.rank] = diagnose.format_stack(frames)
        return where, stacks

    def _hang_error(self, tasks: list[_Task], timeout: float, what: str) -> HangError:
        states = {t.rank: ("still running" if t.outcome is None else
                           "finished" if t.outcome["ok"] else "failed") for t in tasks}
        where, stacks = self._locate([t for t in tasks if t.outcome is None],
                                     time.monotonic() + 4)
        lines = [f"ddplab: the {what} did not finish within timeout={timeout:g} s; "
                 f"ranks are probably waiting for each other (a deadlock)."]
        for rank, state in states.items():
            lines.append(f"  rank {rank}: " + (f"still {where[rank]}" if rank in where else state))
        for rank, stack in stacks.items():
            if stack:
                lines.append(f"Stack of rank {rank} (most recent call last):\n{stack}")
        self._broken = "ranks are stuck after a hang."
        lines.append("Stuck ranks cannot be freed from inside. Recover with: lab.restart()")
        return HangError("\n".join(lines), states, where, stacks)


def _rank_error(failures: dict[int, str]) -> RankError:
    ranks = sorted(failures)
    head = (f"ddplab: the code raised on rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}.")
    body = "\n".join(f"--- rank {rank} ---\n{failures[rank]}" for rank in ranks)
    return RankError(f"{head}\n{body}", failures)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    import psutil
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start(world_size: int = 2, backend: str = "auto", timeout: float = 60, *,
          grace: float = 2.0, pg_timeout: float = 1800, debug: bool = False,
          init_method: str = "store", hosts: Any = None, engines: str | None = None,
          **host_options: Any) -> Lab:
    """Start a lab of ``world_size`` ranks, or return the running one if it matches.

    - ``backend``: ``"auto"`` (nccl with one GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
    - ``timeout``: seconds any cell or ``lab.run`` may take before ``HangError``.
    - ``grace``: seconds a ``%%rank N`` cell waits before returning and leaving the rank running.
    - ``pg_timeout``: the process group's own timeout. Long by default, because
      in the two-prompt style a send may wait while a person reads the next cell.
    - ``debug``: set ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on the ranks, so a
      mismatched collective comes with torch's own explanation.
    - ``init_method``: how the ranks find each other in ``init_process_group``.
      Every rank gets torchrun's variables (RANK, WORLD_SIZE, ...) whichever you pick.

      - ``"store"`` (default): ``env://`` made race-free. Rank 0 opens the
        TCPStore on a socket it has already bound to a free port of 127.0.0.1
        (port 0: the OS picks), reports the port, and every rank calls
        ``init_process_group(store=...)``. Two labs started at once can never
        pick the same port, and the store listens on loopback only.
      - ``"env"``: ``init_process_group(init_method="env://")``, as under
        torchrun: torch reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0
        opens the store on MASTER_PORT, chosen by ``ddplab.env.free_port()``.
      - ``"tcp"``: ``init_method="tcp://127.0.0.1:PORT"`` with ``rank`` and
        ``world_size`` passed in, a free port as for ``"env"``.
      - ``"file"``: ``init_method="file:///<fresh file in the lab's private
        directory>"``, a FileStore; no port at all, so MASTER_ADDR and
        MASTER_PORT are not set. Each start and restart uses a new file.

      With ``"env"`` and ``"tcp"`` torch binds the port a moment after ddplab
      found it free, so another program could take it first (then rank 0 fails
      to start its store), and torch's store listens on every interface.

    - ``hosts=["node1", "node2"]`` or ``engines="ssh"|"mpi"|"slurm"``: ranks on
      several hosts, started by ipyparallel's launchers; see ``ddplab.multihost``
      (its options, such as ``listen=`` or ``ssh_cmd=``, go in ``host_options``).

    Use it as ``with ddplab.start(...) as lab:`` to stop the lab at the end.
    """
    global _current
    if hosts is not None or engines is not None or host_options:
        from .multihost import start_hosts     # every multi-host decision lives there
        return start_hosts(world_size, backend, timeout, hosts=hosts, engines=engines,
                           grace=grace, pg_timeout=pg_timeout, debug=debug, **host_options)
    spec = LabSpec(check_world_size(world_size), backend,
                   check_timeout(timeout), check_timeout(grace, "grace", example=2),
                   check_timeout(pg_timeout, "pg_timeout"), bool(debug),
                   check_init_method(init_method))
    gpus = gpu_count() if spec.backend in ("auto", "nccl") else 0
    lab = Lab(spec, gpus)                  # validates the backend before anything starts
    if _current is not None and _current.running and _current.spec == spec:
        return _current
    if _current is not None:
        _current.stop()
    lab._launch()
    _current = lab
    display.say(f"ddplab: {spec.world_size} ranks ready, backend {lab.backend_reason}.")
    _register_magics()
    return lab


def current() -> Lab:
    """The lab started last and still running; raises if there is none."""
    if _current is None or not _current.running:
        raise DdplabError("ddplab: no lab is running. Start one with lab = ddplab.start(world_size=2).")
    return _current


def _register_magics() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        from .magics import load_ipython_extension
        load_ipython_extension(shell)
