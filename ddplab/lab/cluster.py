"""The local lab: the ``Lab`` class, and the one lab ``current()`` returns.

The lab's lifecycle and failure modes are described in ``ddplab.lab``
(the package docstring); ``ddplab.lab.session`` starts labs.

``Lab`` runs its ranks as engines on this machine. ``ddplab.lab.multihost.HostLab``
runs them on several hosts by overriding the hooks in ``Lab``'s "hooks" section,
and nothing else of ``Lab``'s.
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

from .. import procs, progress
from ..env import check_timeout, choose_backend, free_port, hold_ports, omp_threads, worker_env
from ..errors import ConfigError, DdplabError, EngineDiedError, HangError, RankError
from ..rank import engine
from ..text import plural
from . import diagnose, display, fanout, live, template
from .ranks import LabSpec

HOST = "127.0.0.1"
_GUARD = [sys.executable, "-m", "ddplab.rank.guard"]
# The hub pings engines on this period and registers an engine only after a
# ping, so the period bounds how fast a restart can be (ipyparallel's default
# is 3 s). It declares an engine dead after _HEARTBEAT_MISSES missed pings: 3 s,
# long enough for a starved engine on a loaded laptop to answer.
_HEARTBEAT_MS = 100
_HEARTBEAT_MISSES = 30
# The ports of ipyparallel's controller: 18 with its default schedulers (engines'
# and clients' channels, those between schedulers, the monitor), and room to
# spare; tests/test_reliability.py checks that it listens on no other.
# ddplab holds them while the lab runs (env.hold_ports) instead of letting the
# controller pick free ports that another lab starting this moment could take.
_CONTROLLER_PORTS = 24
# After one rank fails, how long the others get to finish before we conclude
# they are waiting for it (in a collective, or a recv) and report the failure.
FAILURE_SETTLE = 1.0


@dataclass
class Task:
    """One submission to one rank, and what came back."""
    rank: int
    result: Any                    # ipyparallel AsyncResult
    note: str = ""                 # label suffix when shown late
    outcome: dict | None = field(default=None)


class Lab:
    """A running group of ranks. Make one with ``ddplab.start``.

    A subclass that runs ranks elsewhere (``HostLab``) overrides only the
    names in ``HOOKS``.
    """

    #: What a subclass may override; tests/test_multihost.py holds HostLab to it.
    HOOKS = ("_bring_up", "_shut_down", "_join_group", "_wrap", "_check_alive", "_confirm_loss",
             "_frames", "_locate", "_send_interrupt", "restart_keeps_controller")

    def __init__(self, spec: LabSpec, gpus: int) -> None:
        self.spec = spec
        self.backend, self.backend_reason = choose_backend(spec.backend, spec.world_size, gpus)
        self._cluster = None
        self._client = None
        self._views: dict = {}             # engine id(s) -> their DirectView, of _views_of
        self._views_of: Any = None
        self._engine_ids: list[int] = []   # index: torch rank
        self._pids: list[int] = []         # index: torch rank
        self._handles: list = []           # psutil handles of local engines, index: torch rank
        self._dir = ""
        self._port_holds: list = []        # sockets keeping the controller's ports ours
        self._pending: list[Task] = []
        self._broken = ""                  # why the lab needs a restart, if it does
        self._groups = 0                   # process groups formed: names each store and init file
        #: The file of the default rendezvous' FileStore, in the lab's 0700
        #: directory: the latest group's ("" before any); gone after stop().
        self.store_path = ""

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

    @property
    def broken_reason(self) -> str:
        """Why this lab needs ``restart()`` (a hang, a rank stuck after a failure, a lost
        engine), or ``""`` while it is usable or stopped."""
        if self.running and not self._broken:
            try:
                self._check_alive()
            except EngineDiedError:
                pass                      # _check_alive recorded why
        return self._broken

    @property
    def healthy(self) -> bool:
        """Whether the lab is running and usable: every rank alive, none stuck."""
        return self.running and not self.broken_reason

    def start(self) -> "Lab":
        """Start this lab's processes and form the group (``ddplab.start`` does it). Returns the lab."""
        self._dir = tempfile.mkdtemp(prefix="ddplab-")   # mode 0700: only we can read it
        # A script that ends without lab.stop() must not leave files behind;
        # _teardown unregisters this again, so restarts do not pile them up.
        atexit.register(self._teardown)
        try:
            self._bring_up()
        except BaseException:
            self._teardown()
            raise
        self._exit_first()
        self._broken = ""
        return self

    def _exit_first(self) -> None:
        """Make this lab's teardown the first exit handler to run (atexit runs the last
        registered first).

        A kernel that is shut down (Kernel > Shut down) gets about 2.5 s to exit
        before Jupyter sends SIGTERM, then SIGKILL. Handlers registered while the lab
        came up (the engine template's) wait up to 5 s for stuck engines to act on
        SIGTERM; run before ours, they used up that time, the kernel was killed
        between ending the controller (whose guard removes the directory when the
        kernel dies) and removing the directory itself, and the directory stayed.
        Our teardown kills stuck engines at once (``grace=0``), then the rest.
        """
        atexit.unregister(self._teardown)
        atexit.register(self._teardown)

    # ------------------------------------------------ hooks (HostLab overrides these)
    def _bring_up(self) -> None:
        """Start (or connect to) the engines and form the process group."""
        n = self.spec.world_size
        self._cluster = cluster = self._configure_cluster()
        if cluster.engine_launcher_class is template.ForkedEngineSetLauncher:
            template.use(self)
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

    def _configure_cluster(self):
        """An ipyparallel Cluster (not started) set up for a fast, self-cleaning local lab."""
        import ipyparallel as ipp
        n = self.spec.world_size
        parent = {"DDPLAB_PARENT_PID": str(os.getpid())}
        forked = template.enabled()
        if forked:
            template.warm()      # torch imports in the template while the controller starts
        self._port_holds = hold_ports(_CONTROLLER_PORTS, HOST)
        ports = ",".join(str(hold.getsockname()[1]) for hold in self._port_holds)
        cluster = ipp.Cluster(
            n=n, profile_dir=self._dir, cluster_id="lab", log_level=logging.ERROR,
            # ipyparallel's own exit handler would stop the cluster before ours runs,
            # politely: SIGINT, then waiting for engines that a stuck collective keeps
            # from ever answering. ddplab ends its processes itself (_teardown).
            shutdown_atexit=False,
            controller_ip=HOST, delay=0, engine_timeout=max(60, int(self.spec.timeout)),
            # Engines start at once and load torch while the controller comes up.
            send_engines_connection_env=False,
            controller_args=[f"--IPController.ports={ports}",
                             f"--HeartMonitor.period={_HEARTBEAT_MS}",
                             f"--HeartMonitor.max_heartmonitor_misses={_HEARTBEAT_MISSES}"],
            **({"engine_launcher_class": template.ForkedEngineSetLauncher} if forked else {}))
        config = cluster.config
        config.LocalControllerLauncher.controller_cmd = _GUARD + ["ipyparallel.controller"]
        config.LocalControllerLauncher.environment = dict(parent, DDPLAB_CLEANUP_DIR=self._dir)
        config.LocalEngineSetLauncher.engine_cmd = _GUARD + ["ipyparallel.engine"]
        config.LocalEngineSetLauncher.engine_args = [
            # No nanny process: ddplab signals its engines itself (ddplab.procs).
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
        if self.spec.init_method is None:
            # Bare ranks: the student calls init_process_group. One free port
            # per start, so every prompt that reads `port` names the same one.
            # `lab_dir`: an empty folder for file:// files, new at each restart
            # (a file left by an earlier group would deadlock the next one).
            names = {"world_size": n, "port": free_port(HOST),
                     "lab_dir": tempfile.mkdtemp(prefix="files-", dir=self._dir)}
            tasks = [view.apply_async(engine.stay_bare, self._stack_file(rank),
                                      [p for p in sys.path if p], dict(names, rank=rank))
                     for rank, view in enumerate(views)]
            self._pids = [task.get(timeout) for task in tasks]
            self._handles = [procs.process(pid) for pid in self._pids]
            return
        pid_results = [view.apply_async(engine.pid) for view in views]
        method, url, store_path, port = self.spec.init_method, None, None, 0
        self._pids = [r.get(timeout) for r in pid_results]
        self._handles = [procs.process(pid) for pid in self._pids]
        # A fresh file for every group (named by the group's number): one left
        # over from an earlier group already holds its keys, and the new group
        # deadlocks.
        if method == "store":
            self._groups += 1
            store_path = self.store_path = private_file(self._dir, f"store-{self._groups}")
        elif method in ("env", "tcp"):
            # torch's rank 0 binds this port itself, a moment from now: another
            # program could take it first.
            port = free_port(HOST)
            url = "env://" if method == "env" else f"tcp://{HOST}:{port}"
        else:
            self._groups += 1
            url = "file://" + os.path.join(self._dir, f"init-file-{self._groups}")
        tasks = []
        for rank in range(n):
            env = worker_env(rank, n, HOST, port)
            if method in ("store", "file"):   # nobody listens anywhere: say so by leaving them out
                del env["MASTER_ADDR"], env["MASTER_PORT"]
            args = (rank, n, env, self.backend, self.spec.pg_timeout, self._stack_file(rank),
                    [p for p in sys.path if p], url, store_path)
            tasks.append(Task(rank, self._call(rank, engine.call, engine.join_group, args, {})))
        self._await_join(tasks, timeout)

    def _await_join(self, tasks: list[Task], timeout: float) -> None:
        """Wait for the ranks' ``join_group`` calls; raise if one failed or they hang."""
        if self._wait(tasks, timeout) != "done":
            failures = self._replay(tasks)
            if failures:
                raise rank_error(failures)
            raise self._hang_error(tasks, timeout, "init_process_group")

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._dir, f"stack-rank{rank}.txt")

    def _shut_down(self) -> None:
        """End every process this lab started (``ddplab.procs``' policy)."""
        cluster, self._cluster = self._cluster, None
        if self._client is not None:
            self._client.close()
            self._client = None
        if cluster is not None:
            self._kill_engines(cluster)
            # The controller and its scheduler processes do stop on SIGTERM.
            controller = cluster.controller
            if controller is not None:
                procs.end_tree(_popen(controller) or controller.pid, grace=5)
            try:
                cluster.stop_cluster_sync()     # ipyparallel's own bookkeeping; nothing runs now
            except Exception:
                pass
            process = _popen(controller)
            if process is not None:
                try:
                    process.wait(5)             # reap our direct child
                except Exception:
                    pass
        template.release(self)

    def _teardown(self) -> None:
        """End every process this lab started and remove its files (even if ending one failed)."""
        try:
            self._shut_down()
        finally:
            self._forget()

    def _forget(self) -> None:
        """Drop what a stopped lab held: pending cells, ranks, its directory, its atexit hook."""
        self._pending.clear()
        self._pids, self._handles, self._engine_ids = [], [], []
        for hold in self._port_holds:    # the controller is gone: its ports go back
            hold.close()
        self._port_holds = []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""
        atexit.unregister(self._teardown)

    def stop(self) -> None:
        """End every engine and the controller, and remove the lab's files.

        It also ends the kernel's engine template (``ddplab.lab.template``) unless
        another lab is running: after ``lab.stop()`` nothing ddplab started is
        left running. ``start()`` replacing one lab by another keeps it warm.
        """
        self._retire()
        template.stop_if_unused()

    def _retire(self) -> None:
        """Stop this lab and stop being the current one; the template lives on."""
        self._teardown()
        if _current is self:
            make_current(None)

    #: A restart keeps the controller and replaces only the engines: the
    #: controller holds no rank state, and starting one is half of a restart.
    restart_keeps_controller = True

    def restart(self) -> "Lab":
        """Replace every engine with a fresh one; ranks stay 0..N-1. Returns the lab.

        After ``lab.stop()`` this starts the lab again, and it becomes the
        current lab (what ``%%ranks`` and ``ddplab.start()`` find) unless
        another lab is running as the current one by then.
        """
        if self.restart_keeps_controller and self._controller_alive():
            try:
                self._replace_engines()
                return self
            except BaseException:
                self._teardown()
                raise
        self._teardown()
        self.start()
        if _current is None or _current is self or not _current.running:
            make_current(self)
        return self

    def _controller_alive(self) -> bool:
        controller = self._cluster.controller if self._cluster is not None else None
        return self._client is not None and controller is not None and \
            procs.alive(_popen(controller) or controller.pid)

    def _replace_engines(self) -> None:
        """Kill every engine, start new ones on the same controller, and join them into a group."""
        cluster, n = self._cluster, self.spec.world_size
        self._pending.clear()
        old_ids = set(self._client.ids)
        self._kill_engines(cluster)
        cluster.stop_engines_sync()          # forget the dead engines' launchers
        for name in os.listdir(self._dir):   # a reused store file would deadlock the new group
            if name.startswith(("init-file", "store-", "stack-rank")):
                os.remove(os.path.join(self._dir, name))
        cluster.start_engines_sync(n=n)
        # The hub forgets the old engines a few heartbeats later; do not wait for
        # that, wait for n engines it has not seen before.
        deadline = time.monotonic() + cluster.engine_timeout
        while len(new := set(self._client.ids) - old_ids) < n:
            if time.monotonic() > deadline:
                raise EngineDiedError(f"ddplab: only {len(new)} of {n} new engines registered "
                                      f"within {cluster.engine_timeout} s.", [])
            time.sleep(0.01)
        self._engine_ids = sorted(new)[:n]
        self._client[self._engine_ids].use_cloudpickle()
        self._join_group()
        self._exit_first()                   # a template started anew registered its own handler
        self._broken = ""

    def _kill_engines(self, cluster) -> list:
        """End every engine and what it started, at once; return their launchers."""
        engines = [launcher for engine_set in cluster.engines.values()
                   for launcher in engine_set.launchers.values()]
        # Each engine leads its own session (the template or the guard calls
        # setsid), and what its rank started (multiprocessing, subprocess,
        # os.fork, orphans too) stays in it: end the sessions too, even of
        # engines already gone. Engines stuck in a C++ collective never act on
        # SIGTERM (ipyparallel's handler is Python code), and hold no state
        # worth saving: no grace.
        tree = procs.Tree([*self._handles, *[_popen(e) or e.pid for e in engines]])
        for pid in self._pids:
            tree.add_session(pid)
        tree.note()
        tree.end(grace=0)
        for launcher in engines:
            process = _popen(launcher)
            if process is not None:
                try:
                    process.wait(5)           # reap our own children
                except Exception:
                    pass
        self._pids, self._handles = [], []
        return engines

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

    def ensure_usable(self) -> None:
        """Raise ``DdplabError`` saying how to recover if the lab is stopped or broken."""
        if not self.running:
            raise DdplabError("ddplab: this lab is stopped. Start one with "
                              "lab = ddplab.start(...) or call lab.restart().")
        if self._broken:
            raise DdplabError(f"ddplab: {self._broken} Recover with: lab.restart()")
        self._check_alive()

    def _check_alive(self, wait: float = 0.0) -> None:
        """Raise ``EngineDiedError`` naming the ranks whose engine is gone (``wait``: HostLab's)."""
        dead = [rank for rank, handle in enumerate(self._handles) if not procs.alive(handle)]
        if dead:
            causes = {rank: diagnose.death(template.ended(self._pids[rank])) for rank in dead}
            if len(set(causes.values())) == 1:
                self._broken = (f"the engine of {plural(len(dead), 'rank')} "
                                f"{', '.join(map(str, dead))} {causes[dead[0]]}")
            else:
                self._broken = "engines died: " + "; ".join(
                    f"rank {rank} {cause.rstrip('.')}" for rank, cause in causes.items()) + "."
            raise EngineDiedError(f"ddplab: {self._broken} Recover with: lab.restart()", dead)

    def _call(self, rank: int, fn: Callable, *args: Any) -> Any:
        """Call ``fn(*args)`` on ``rank``'s engine; an AsyncResult."""
        return self._wrap(self._view(self._engine_ids[rank]).apply_async(fn, *args))

    def _wrap(self, result: Any) -> Any:
        """What the lab waits on for one rank's call (HostLab adds which host was lost)."""
        return result

    def _view(self, engine_ids: int | tuple[int, ...]) -> Any:
        """ipyparallel's view of one engine or several, made once (making one costs more than a call)."""
        if self._views_of is not self._client:       # a new client: views of the old are stale
            self._views, self._views_of = {}, self._client
        view = self._views.get(engine_ids)
        if view is None:
            targets = list(engine_ids) if isinstance(engine_ids, tuple) else engine_ids
            view = self._views[engine_ids] = self._client[targets]
        return view

    def _submit(self, ranks: list[int], fn: Callable, *args: Any) -> list[Task]:
        """``fn(*args)`` on each of ``ranks``: one message per engine, the function pickled once."""
        if len(ranks) == 1:
            return [Task(ranks[0], self._call(ranks[0], fn, *args))]
        view = self._view(tuple(self._engine_ids[rank] for rank in ranks))
        return [Task(rank, self._wrap(result))
                for rank, result in zip(ranks, fanout.apply_to_each(view, fn, *args))]

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
        self.ensure_usable()
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
        self.ensure_usable()
        self._finish(self._submit(chosen, engine.run_cell, source), timeout, grace)

    def trace(self, ranks: Iterable[int] | None = None, align: str = "auto") -> Any:
        """Record what the ranks' torch.distributed calls do: ``with lab.trace() as tr:``.

        ``tr`` then draws one lane per rank; see ``ddplab.trace``.
        """
        from ..trace import Trace
        return Trace(self, ranks, align)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for cells still running from earlier ``%%rank`` cells and show their output."""
        timeout = self.spec.timeout if timeout is None else check_timeout(timeout)
        self.ensure_usable()
        # Waited for on purpose: their failures are this call's, and raise.
        earlier, self._pending = self._pending, []
        self._finish(earlier, timeout, grace=None)

    def _finish(self, tasks: list[Task], timeout: float, grace: float | None) -> None:
        """Wait for ``tasks`` and earlier pending tasks, show output, raise on failure.

        A failure of an earlier cell (one left running after its grace) is shown,
        labelled as that cell's, and never fails this call or changes its result.
        """
        pending, self._pending = self._pending, []
        everything = pending + tasks
        state = self._wait(everything, timeout if grace is None else grace, own=tasks)
        if state == "timeout" and grace is None:
            self._replay(everything, stuck=True)
            raise self._hang_error(everything, timeout, "cell")
        still = [t for t in everything if t.outcome is None]
        failures = _failures(tasks)
        # Ranks still running beside a failure are about to be reported stuck.
        self._replay(everything, stuck=bool(failures and still))
        late = _failures(pending)
        if failures and still:
            # A rank failed while others wait for it in a collective: they
            # would wait until the group's timeout, so report it now.
            raise self._stuck_after_failure(failures, still)
        for task in still:
            task.note = "(the earlier cell that was still running)"
        self._pending = still
        if late:
            display.say("\n".join(
                f"ddplab: the earlier cell still running on rank {rank} raised (this is that "
                f"cell's error, not this cell's):\n{error}" for rank, error in sorted(late.items())))
        joining = self._joining(still)
        if joining:
            display.say(diagnose.joining_message(joining, self.world_size))
        elif still:
            self._say_still_running(still)
        if failures:
            raise rank_error(failures)

    def _joining(self, still: list[Task]) -> list[int]:
        """On bare ranks: the still-running ranks, if every one waits in init_process_group."""
        if self.spec.init_method is not None or not still:
            return []
        where = self._locate(still, time.monotonic() + 2)[0]
        if all(diagnose.waiting_to_join(w) for w in where.values()):
            return sorted(where)
        return []

    def _say_still_running(self, still: list[Task]) -> None:
        """Say which ranks a cell left running, and whether each waits for another rank."""
        ranks = sorted({t.rank for t in still})
        frames = self._frames([t for t in still if t.rank in ranks], time.monotonic() + 4)
        doing = {rank: diagnose.activity(frames.get(rank, [])) for rank in ranks}
        waiting = [rank for rank in ranks if doing[rank][0]]
        tail = ("It keeps running; its output appears when a later ddplab cell finishes, "
                "or call lab.wait().")
        if len(ranks) == 1:
            rank, (in_dist, what) = ranks[0], doing[ranks[0]]
            why = (f"{what}: waiting for another rank (a send waits for its recv, a collective "
                   f"for every rank). Run the matching cell on the other rank." if in_dist else
                   f"{what}, not inside a torch.distributed call: it is busy with its own "
                   f"work, not waiting for another rank.")
            display.say(f"ddplab: rank {rank} is still running this cell, {why} {tail}")
            return
        lines = [f"ddplab: ranks {', '.join(map(str, ranks))} are still running this cell:"]
        lines += [f"  rank {rank}: {what}, " + ("waiting for another rank" if in_dist else
                                                "not inside a torch.distributed call (busy, "
                                                "not waiting)")
                  for rank, (in_dist, what) in doing.items()]
        if waiting:
            lines.append("A rank inside a torch.distributed call waits for the matching call "
                         "on the other ranks: run that cell.")
        lines.append(tail.replace("It keeps", "They keep").replace("its output", "their output"))
        display.say("\n".join(lines))

    @staticmethod
    def _replay(tasks: list[Task], stuck: bool = False) -> dict[int, str]:
        """Show finished tasks' output in rank order; return their failures by rank.

        ``stuck``: the unfinished tasks are stuck (a hang is about to be
        reported), so show what they printed before, from their live screens.
        """
        failures: dict[int, str] = {}
        for task in sorted(tasks, key=lambda t: t.rank):
            if task.outcome is not None:
                display.replay(task.rank, task.outcome["events"], task.note)
                if not task.outcome["ok"]:
                    failures[task.rank] = task.outcome["error"]
            elif stuck:
                _replay_stuck(task)
        return failures

    def _wait(self, tasks: list[Task], timeout: float, own: list[Task] | None = None) -> str:
        """Wait for ``tasks``; return ``"done"``, ``"failed"`` or ``"timeout"``.

        ``"failed"``: a rank failed and the others have not finished for
        ``FAILURE_SETTLE`` seconds, so they are most likely waiting for it.
        Only failures of ``own`` (default: all of ``tasks``) count: an earlier
        cell's late failure blocks nobody in this call.
        """
        own_ids = {id(t) for t in (tasks if own is None else own)}
        deadline = time.monotonic() + timeout
        failed_at = None
        board = progress.Board()                 # live bars, once a rank calls progress.report
        areas = live.Board()                     # live output, once a rank prints
        try:
            while True:
                for task in tasks:
                    if task.outcome is None and task.result.ready():
                        task.outcome = task.result.get()
                board.update({t.rank: t.result for t in tasks})
                areas.update(tasks)
                undone = [t for t in tasks if t.outcome is None]
                if not undone:
                    return "done"
                now = time.monotonic()
                if failed_at is None and any(not t.outcome["ok"] for t in tasks
                                             if t.outcome and id(t) in own_ids):
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
        finally:
            areas.close()                        # the final output is printed after this

    def _send_interrupt(self, ranks: list[int]) -> None:
        """Deliver SIGINT to these ranks' engines."""
        for rank in ranks:
            procs.send(self._handles[rank], signal.SIGINT)

    def _interrupt(self, tasks: list[Task]) -> None:
        """Kernel > Interrupt: pass SIGINT on to the ranks still running."""
        running = [t for t in tasks if not t.result.ready()]
        self._send_interrupt([t.rank for t in running])
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

    def _confirm_loss(self, failures: dict[int, str]) -> None:
        """A rank failed while others wait: raise ``EngineDiedError`` if a rank was lost."""

    def _stuck_after_failure(self, failures: dict[int, str], still: list[Task]) -> RankError:
        self._confirm_loss(failures)
        where = self._locate(still, time.monotonic() + 4)[0]
        self._broken = "ranks are stuck waiting for a rank that failed."
        error = rank_error(failures)
        lines = [str(error), "Meanwhile:"]
        lines += [f"  rank {rank}: still {where[rank]}, waiting for the failed rank"
                  for rank in sorted(where)]
        lines.append("Those ranks cannot be freed from inside. Recover with: lab.restart()")
        return RankError("\n".join(lines), failures)

    def _frames(self, tasks: list[Task], deadline: float) -> dict[int, list]:
        """For each running task's rank: its main stack's frames, innermost first."""
        return {task.rank: diagnose.main_thread_stack(diagnose.dump_stack(
                    self._handles[task.rank], self._stack_file(task.rank), deadline))
                for task in sorted(tasks, key=lambda t: t.rank)}

    def _locate(self, tasks: list[Task], deadline: float) -> tuple[dict, dict]:
        """For each running task's rank: a one-line location and a short stack."""
        frames = self._frames(tasks, deadline)
        return ({rank: diagnose.where(f) for rank, f in frames.items()},
                {rank: diagnose.format_stack(f) for rank, f in frames.items()})

    def _hang_error(self, tasks: list[Task], timeout: float, what: str) -> HangError:
        states = {t.rank: ("still running" if t.outcome is None else
                           "finished" if t.outcome["ok"] else "failed") for t in tasks}
        where, stacks = self._locate([t for t in tasks if t.outcome is None],
                                     time.monotonic() + 4)
        lines = [f"ddplab: the {what} did not finish within timeout={timeout:g} s; "
                 f"ranks are probably waiting for each other (a deadlock)."]
        for rank, state in states.items():
            lines.append(f"  rank {rank}: " + (f"still {where[rank]}" if rank in where else state))
        if any(diagnose.waiting_to_join(w) for w in where.values()):
            lines.append(diagnose.join_hint(self.world_size))
        for rank, stack in stacks.items():
            if stack:
                lines.append(f"Stack of rank {rank} (most recent call last):\n{stack}")
        self._broken = "ranks are stuck after a hang."
        lines.append("Stuck ranks cannot be freed from inside. Recover with: lab.restart()")
        return HangError("\n".join(lines), states, where, stacks)


def private_file(directory: str, name: str) -> str:
    """Create the empty file ``directory/name``, readable and writable by its owner only.

    The lab's rendezvous store lives in it. ``FileStore`` would create the file
    itself, but with mode 0644 (less the umask); made here first, it stays 0600,
    a second lock besides the 0700 directory.
    """
    path = os.path.join(directory, name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def _failures(tasks: list[Task]) -> dict[int, str]:
    return {t.rank: t.outcome["error"] for t in tasks
            if t.outcome is not None and not t.outcome["ok"]}


def _replay_stuck(task: Task) -> None:
    """Show what a stuck rank printed before it got stuck: its last live screen."""
    text = live.screen(task.result)
    if text:
        last = text if text.endswith("\n") else text + "\n"
        display.replay(task.rank, [("stdout", last)],
                       "(stuck; what it printed last, before the diagnosis below)")


def rank_error(failures: dict[int, str]) -> RankError:
    """The ``RankError`` for tracebacks by rank: one head line, then each rank's traceback."""
    ranks = sorted(failures)
    head = f"ddplab: the code raised on {plural(len(ranks), 'rank')} {', '.join(map(str, ranks))}."
    body = "\n".join(f"--- rank {rank} ---\n{failures[rank]}" for rank in ranks)
    return RankError(f"{head}\n{body}", failures)


def _popen(launcher: Any):
    """An ipyparallel launcher's ``Popen``, when it started a local process."""
    return getattr(launcher, "process", None)


# ------------------------------------------------------------- the current lab
_current: "Lab | None" = None


def current() -> Lab:
    """The lab started last and still running; raises if there is none."""
    if _current is None or not _current.running:
        raise DdplabError("ddplab: no lab is running. Start one with lab = ddplab.start(world_size=2).")
    return _current


def current_or_none() -> "Lab | None":
    """The lab made current last, running or not, or None."""
    return _current


def make_current(lab: "Lab | None") -> None:
    """Make ``lab`` the one ``current()``, ``%%ranks`` and the checkers use."""
    global _current
    _current = lab


def stop_current() -> None:
    """Stop the current lab, if any, as another replaces it (the engine template stays warm)."""
    if _current is not None:
        _current._retire()
