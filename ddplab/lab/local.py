"""``LocalRanks``: a lab's ranks as engines on this machine (the ``Ranks`` interface).

One ipyparallel controller and one engine per rank, the engines forked from
the kernel's warm template (``ddplab.lab.template``). The lab's files live in a
fresh owner-only directory (``directory``): the controller's Unix sockets,
ipyparallel's connection files with their signing key, the rendezvous store,
each rank's stack file. The engines live in the template's network of its own
(``ddplab.rank.netns``), so their gloo sockets on 127.0.0.1 are out of every
other user's reach; where the machine forbids that, ``describe()`` says what
is exposed. Because every process is ours and local, this implementation can
do what a multi-host one cannot: signal a rank (SIGINT for Kernel > Interrupt,
SIGUSR1 to read its stack), see at once that an engine died and how (the
template reports its exit status), and replace the engines while keeping the
controller (a restart under a second).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
from typing import Any, Callable

from .. import procs
from ..env import choose_backend, free_port, note_rank_memory, omp_threads, worker_env
from ..errors import EngineDiedError
from ..rank import engine
from ..rank.where import NO_STACK
from ..text import plural
from . import diagnose, flight, template
from .ranks import EngineSet, Joins, LabSpec, Loss, heartbeat_args

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_TETHERED = [sys.executable, "-m", "ddplab.rank.tether"]


def private_file(directory: str, name: str) -> str:
    """Create the empty file ``directory/name``, readable and writable by its owner only.

    The lab's rendezvous store lives in it. ``FileStore`` would create the file
    itself, but with mode 0644 (less the umask); made here first, it stays 0600,
    a second lock besides the 0700 directory.
    """
    path = os.path.join(directory, name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def _unix_socket_args(directory: str) -> list[str]:
    """The controller's arguments for Unix sockets ``directory/c:1`` ... instead of TCP ports.

    With the ipc transport a "port" only names a socket file, so a fixed list
    of small numbers does (18 with ipyparallel's default schedulers, and room
    to spare): nothing to find free, nothing another lab could take.
    """
    names = ",".join(str(number) for number in range(1, 25))
    return ["--IPController.transport=ipc", f"--IPController.ip={directory}/c",
            f"--IPController.ports={names}"]


def _local_process(launcher: Any) -> Any:
    """What an ipyparallel launcher started here: its process object, else its pid."""
    return getattr(launcher, "process", None) or launcher.pid


class LocalRanks:
    """Engines on this machine, one per rank; see this module's docstring."""

    def __init__(self, spec: LabSpec, gpus: int) -> None:
        self.spec = spec
        # Validates the backend before anything starts.
        self.backend, self.backend_reason = choose_backend(spec.backend, spec.world_size, gpus)
        self.running = False
        self.directory = ""
        self.store_path = ""          # the latest group's FileStore file ("" before any)
        self._cluster: Any = None
        #: The ipyparallel client and each rank's engine (None while stopped).
        self.engine_set: EngineSet | None = None
        self._pids: list[int] = []    # index: torch rank
        self._handles: list = []      # psutil handles, index: torch rank
        #: Why the ranks share this machine's network ("" when they have their own).
        self.network_shared_because = ""
        self._groups = 0              # process groups formed: names each store and init file

    # ------------------------------------------------------------- state
    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    @property
    def controller_pid(self) -> int | None:
        controller = self._cluster.controller if self._cluster is not None else None
        return None if controller is None else controller.pid

    @property
    def hosts(self) -> list[dict]:
        return [{"node_rank": 0, "address": HOST, "hostname": "localhost",
                 "ranks": list(range(self.world_size))}]

    def describe(self) -> str:
        ready = f"{self.world_size} {plural(self.world_size, 'rank')} ready, backend {self.backend_reason}."
        if not self.network_shared_because:
            return ready
        # The one line a student on a shared machine needs to see (issue: labs no
        # other user can reach); silent where the lab has a network of its own.
        return (f"{ready}\nddplab: the ranks share this machine's network, because "
                f"{self.network_shared_because}: other users of this machine can connect to "
                f"their gloo sockets on 127.0.0.1 (the controller is on Unix sockets in the "
                f"lab's private folder either way).")

    # ------------------------------------------------------------- forming
    def bring_up(self) -> Joins:
        """Start the controller and the engines; the joins that form the process group."""
        self.directory = tempfile.mkdtemp(prefix="ddplab-")   # mode 0700: only we can read it
        self.running = True
        n = self.spec.world_size
        self._cluster = cluster = self._configure_cluster()
        if cluster.engine_launcher_class is template.ForkedEngineSetLauncher:
            template.use(self)
        cluster.start_cluster_sync(n=n)
        client = cluster.connect_client_sync()
        # interactive=False: ipyparallel's own progress bar is noise in a lesson.
        client.wait_for_engines(n, timeout=cluster.engine_timeout, interactive=False)
        self.engine_set = EngineSet(client, sorted(client.ids)[:n])
        self.network_shared_because = template.network_shared_because()
        return self._joins()

    def formed(self) -> None:
        # What a forked rank costs of its own, for the next lab's memory check (ms).
        note_rank_memory(self._pids)

    def _configure_cluster(self) -> Any:
        """An ipyparallel Cluster (not started) set up for a fast, self-cleaning local lab."""
        import ipyparallel as ipp
        n = self.spec.world_size
        parent = {"DDPLAB_PARENT_PID": str(os.getpid())}
        forked = template.enabled()
        if forked:
            template.warm()      # torch imports in the template while the controller starts
        cluster = ipp.Cluster(
            n=n, profile_dir=self.directory, cluster_id="lab", log_level=logging.ERROR,
            # ipyparallel's own exit handler would stop the cluster before ours runs,
            # politely: SIGINT, then waiting for engines that a stuck collective keeps
            # from ever answering. ddplab ends its processes itself (shut_down).
            shutdown_atexit=False,
            delay=0, engine_timeout=int(self.spec.start_timeout),
            # Engines start at once and load torch while the controller comes up.
            send_engines_connection_env=False,
            controller_args=[*_unix_socket_args(self.directory), *heartbeat_args()],
            **({"engine_launcher_class": template.ForkedEngineSetLauncher} if forked else {}))
        config = cluster.config
        config.LocalControllerLauncher.controller_cmd = _TETHERED + ["ddplab.rank.ipc_controller"]
        config.LocalControllerLauncher.environment = dict(parent, DDPLAB_CLEANUP_DIR=self.directory)
        config.LocalEngineSetLauncher.engine_cmd = _TETHERED + ["ipyparallel.engine"]
        config.LocalEngineSetLauncher.engine_args = [
            # No nanny process: ddplab signals its engines itself (ddplab.procs).
            "--IPEngine.enable_nanny=False", "--IPEngine.wait_for_url_file=120",
            # An engine waits for the controller's answer to its registration as long as the
            # start waits for the engine, not ipyparallel's 5 s: the controller writes the file
            # engines wait for, then starts its schedulers before it answers, which took over
            # 5 s on a loaded machine; the engine then exited for good, and the start waited
            # for it until its timeout (tests/test_slow_controller.py).
            f"--IPEngine.timeout={cluster.engine_timeout}"]
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

    def _joins(self) -> Joins:
        n, timeout = self.spec.world_size, self.spec.start_timeout
        kernel_path = [p for p in sys.path if p]
        if self.spec.init_method is None:
            # Bare ranks: the student calls init_process_group. One free port
            # per start, so every prompt that reads `port` names the same one.
            # `lab_dir`: an empty folder for file:// files, new at each restart
            # (a file left by an earlier group would deadlock the next one).
            names = {"world_size": n, "port": free_port(HOST),
                     "lab_dir": tempfile.mkdtemp(prefix="files-", dir=self.directory)}
            results = [self.engine_set.apply([rank], engine.stay_bare, self._stack_file(rank),
                                           kernel_path, dict(names, rank=rank))[0]
                       for rank in range(n)]
            self._note_pids([r.get(timeout) for r in results])
            return {}
        self._note_pids([r.get(timeout) for r in self.engine_set.apply(list(range(n)), engine.pid)])
        method, url, store_path, port = self.spec.init_method, None, None, 0
        # A fresh file for every group (named by the group's number): one left
        # over from an earlier group already holds its keys, and the new group
        # deadlocks.
        if method == "store":
            self._groups += 1
            store_path = self.store_path = private_file(self.directory, f"store-{self._groups}")
        elif method in ("env", "tcp"):
            # torch's rank 0 binds this port itself, a moment from now: another
            # program could take it first.
            port = free_port(HOST)
            url = "env://" if method == "env" else f"tcp://{HOST}:{port}"
        else:
            self._groups += 1
            url = "file://" + os.path.join(self.directory, f"init-file-{self._groups}")
        joins = {}
        for rank in range(n):
            env = worker_env(rank, n, HOST, port)
            if method in ("store", "file"):   # nobody listens anywhere: say so by leaving them out
                del env["MASTER_ADDR"], env["MASTER_PORT"]
            joins[rank] = (rank, n, env, self.backend, self.spec.pg_timeout,
                           self._stack_file(rank), kernel_path, url, store_path)
        return joins

    def _note_pids(self, pids: list[int]) -> None:
        self._pids = pids
        self._handles = [procs.process(pid) for pid in pids]

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.directory, f"stack-rank{rank}.txt")

    # ------------------------------------------------------------- running
    def apply(self, ranks: list[int], fn: Callable, *args: Any) -> list[Any]:
        return self.engine_set.apply(ranks, fn, *args)

    def lost(self, wait: float = 0.0) -> Loss | None:
        """The ranks whose engine is gone, and how each ended (the template knows)."""
        dead = [rank for rank, handle in enumerate(self._handles) if not procs.alive(handle)]
        if not dead:
            return None
        causes = {rank: diagnose.death(template.ended(self._pids[rank]),
                                     diagnose.fatal_where(self._stack_file(rank)))
                  for rank in dead}
        if len(set(causes.values())) == 1:
            reason = (f"the engine of {plural(len(dead), 'rank')} "
                      f"{', '.join(map(str, dead))} {causes[dead[0]]}")
        else:
            reason = "engines died: " + "; ".join(
                f"rank {rank} {cause.rstrip('.')}" for rank, cause in causes.items()) + "."
        return Loss(dead, reason)

    def confirm_loss(self, failures: dict[int, str]) -> Loss | None:
        """Local engines that die are seen at once (``lost``): nothing to wait for."""
        return None

    def frames(self, ranks: list[int], deadline: float) -> dict[int, list]:
        """Each rank's main stack, innermost first, read through faulthandler (SIGUSR1)."""
        return {rank: diagnose.main_thread_stack(diagnose.dump_stack(
                    self._handles[rank], self._stack_file(rank), deadline))
                for rank in sorted(ranks)}

    def out_of_reach(self, rank: int) -> str:
        """A local rank whose stack did not come (it did not answer the signal in time)."""
        return NO_STACK

    def collectives(self, ranks: list[int], deadline: float) -> dict[int, list[dict]]:
        """Each rank's latest collectives per group, from torch's flight recorder."""
        return flight.ask({rank: (self._stack_file(rank) + ".fr", self._stack_file(rank) + ".fr.json")
                           for rank in ranks}, deadline)

    def cpu_seconds(self, ranks: list[int]) -> dict[int, float]:
        """The CPU time each rank's engine and its live descendants (a DataLoader's workers) used."""
        return {rank: sum(procs.cpu_times([self._handles[rank],
                                           *procs.descendants(self._handles[rank])]).values())
                for rank in ranks}

    def recorded(self, ranks: list[int], deadline: float) -> dict[int, dict]:
        """What a running ``lab.trace()`` recorded so far on each rank, even a stuck one."""
        return flight.ask({rank: (self._stack_file(rank) + ".fr",
                                  self._stack_file(rank) + ".fr.json.trace") for rank in ranks},
                          deadline, b"T")

    def interrupt(self, ranks: list[int]) -> None:
        for rank in ranks:
            procs.send(self._handles[rank], signal.SIGINT)

    # ------------------------------------------------------------- replacing, ending
    def replace(self) -> Joins | None:
        """Kill every engine, start new ones on the same controller; the joins of a new group.

        The controller holds no rank state, and starting one is half of a
        restart, so it stays. None (nothing done) when the controller is gone.
        """
        controller = self._cluster.controller if self._cluster is not None else None
        if self.engine_set is None or controller is None or \
                not procs.alive(_local_process(controller)):
            return None
        cluster, n, client = self._cluster, self.spec.world_size, self.engine_set.client
        old_ids = set(client.ids)
        self._kill_engines(cluster)
        cluster.stop_engines_sync()          # forget the dead engines' launchers
        for name in os.listdir(self.directory):   # a reused store file would deadlock the new group
            if name.startswith(("init-file", "store-", "stack-rank")):
                os.remove(os.path.join(self.directory, name))
        cluster.start_engines_sync(n=n)
        # The hub forgets the old engines a few heartbeats later; do not wait for
        # that, wait for n engines it has not seen before.
        deadline = time.monotonic() + cluster.engine_timeout
        while len(new := set(client.ids) - old_ids) < n:
            if time.monotonic() > deadline:
                raise EngineDiedError(f"ddplab: only {len(new)} of {n} new engines registered "
                                      f"within {cluster.engine_timeout} s.", [])
            time.sleep(0.01)
        self.engine_set = EngineSet(client, sorted(new)[:n])
        return self._joins()

    def _kill_engines(self, cluster: Any) -> None:
        """End every engine and what it started, at once."""
        launchers = [launcher for engine_set in cluster.engines.values()
                     for launcher in engine_set.launchers.values()]
        # Each engine leads its own session (the template or the tether calls
        # setsid), and what its rank started (multiprocessing, subprocess,
        # os.fork, orphans too) stays in it: end the sessions too, even of
        # engines already gone. Engines stuck in a C++ collective never act on
        # SIGTERM (ipyparallel's handler is Python code), and hold no state
        # worth saving: no grace.
        # A launcher that never got to start its engine (the template failed to
        # start) has pid -1: nothing to end, and the error worth showing is that one.
        started = [_local_process(e) for e in launchers if getattr(e, "process", None) or
                   (e.pid or 0) > 0]
        tree = procs.Tree([*self._handles, *started])
        for pid in self._pids:
            tree.add_session(pid)
        tree.note()
        tree.end(grace=0)
        for launcher in launchers:
            _reap(launcher)
        self._pids, self._handles = [], []

    def shut_down(self) -> None:
        """End every process this lab started (``ddplab.procs``' policy) and remove its files."""
        cluster, self._cluster = self._cluster, None
        engines, self.engine_set = self.engine_set, None
        self.running = False
        try:
            if engines is not None:
                engines.close()
            if cluster is not None:
                self._kill_engines(cluster)
                # The controller and its scheduler processes do stop on SIGTERM.
                controller = cluster.controller
                if controller is not None:
                    procs.end_tree(_local_process(controller), grace=5)
                try:
                    cluster.stop_cluster_sync()  # ipyparallel's own bookkeeping; nothing runs now
                except Exception:
                    log.debug("ipyparallel's stop_cluster after ours failed", exc_info=True)
                if controller is not None:
                    _reap(controller)
        finally:
            template.release(self)
            self._forget()

    def _forget(self) -> None:
        """Drop what a stopped lab held: its ranks, the controller's ports, its directory."""
        import shutil
        self._pids, self._handles = [], []
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""


def _reap(launcher: Any) -> None:
    """Collect the exit status of a child process we started ourselves, if it is one."""
    process = getattr(launcher, "process", None)
    if process is None or not hasattr(process, "wait"):
        return
    try:
        process.wait(5)
    except Exception:
        log.debug("reaping %r failed", launcher, exc_info=True)
