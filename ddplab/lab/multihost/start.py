"""Starting and stopping engines on other hosts, through ipyparallel's own launchers.

``ddplab.lab.multihost.host_ranks`` forms a group over engines; this module is how those
engines come to exist when ddplab starts them (``start(hosts=...)`` over SSH,
``engines="slurm"``, ``engines="mpi"``): the arguments checked, ipyparallel's
``Cluster`` configured, started and, at the end, stopped with everything it
started. ``attach`` never comes here: engines you started stay yours.

The one seam ``ranks`` (``HostRanks``) uses: ``plan(...)`` checks the arguments and returns
a ``HostEngines``; ``HostEngines.start(profile_dir, spec)`` starts the controller and the
engines, waits until they registered and returns a connected ``Client``;
``HostEngines.stop()`` ends them.

- SSH: ``ssh`` (one session per host, all at once; ``ssh_cmd`` does all
  of it, so ssh-config aliases and options work).
- Slurm and MPI: ipyparallel's launchers, watched by ``batch``.
- A start that cannot succeed fails within a second or two of the cause
  (an engine, the job or mpiexec exited), with its output in the message;
  that output is kept in ``log_dir()`` (``DDPLAB_LOG_DIR``, by default
  ``~/.cache/ddplab/logs``), named in the message.
- ``stop()`` (also after a failed start) ends the engines on every host (for
  Slurm: scancel, and waits until the job is gone), the controller, and
  removes the hosts' directories and the batch file; ipyparallel writes no
  cluster file and has no exit handler of its own to re-create the lab's
  directory. If the kernel dies, the controller's tether ends it, the SSH
  agents end their engines when their ssh session closes, mpiexec's watcher
  ends it, and Slurm engines stop after missing the controller's heartbeat
  for ``ENGINE_MISSES`` checks (about 6 s), which ends their job.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ... import hosts as placing, procs
from ...env import omp_threads
from ...errors import ConfigError, DdplabError
from ..ranks import LabSpec, heartbeat_args
from . import batch, ssh

log = logging.getLogger(__name__)

#: Launchers ``start(engines=...)`` accepts: ipyparallel's own names.
ENGINE_LAUNCHERS = ("ssh", "mpi", "slurm")
_LAUNCHER_CLASS = {"ssh": "SSHEngineSetLauncher", "mpi": "MPIEngineSetLauncher",
                   "slurm": "SlurmEngineSetLauncher"}
#: Engines we start exit after missing this many heartbeat checks of the controller (each its
#: period + 0.5 s): a controller gone with its kernel takes them, and their job, along.
ENGINE_MISSES = 10
#: The least ipyparallel lets an engine on another host take to register (and the engine waits
#: for the controller's answer), however short the start's own wait (``LabSpec.start_timeout``):
#: a remote start (ssh, a batch queue) is slower than a fork here.
REMOTE_ENGINE_TIMEOUT = 120
_TETHERED = ["-m", "ddplab.rank.tether"]


def security_args() -> list[str]:
    """ipcontroller arguments: CurveZMQ on, and message signing kept on with a fresh key."""
    return ["--IPController.enable_curve=True", f"--Session.key={secrets.token_hex(32)}"]


def split_hosts(hosts_arg: Any, world_size: int) -> dict[str, int]:
    """``["a", "b"]`` with world_size 4 -> ``{"a": 2, "b": 2}``; a dict is taken as given."""
    if isinstance(hosts_arg, str):
        raise ConfigError(f"ddplab: hosts={hosts_arg!r} is one string; hosts takes a list. "
                          f"Use hosts=[{hosts_arg!r}].")
    if isinstance(hosts_arg, dict):
        counts = {str(h): int(k) for h, k in hosts_arg.items()}
    else:
        names = [str(h) for h in hosts_arg]
        if not names or world_size % len(names):
            raise ConfigError(f"ddplab: world_size={world_size} does not split evenly over "
                              f"{len(names)} hosts. Use a multiple of {len(names) or 1}, or "
                              f"hosts={{'host': ranks, ...}}.")
        counts = {h: world_size // len(names) for h in names}
    if sum(counts.values()) != world_size:
        raise ConfigError(f"ddplab: hosts={counts} hold {sum(counts.values())} ranks, but "
                          f"world_size={world_size}. Make them agree.")
    return counts


def address(host: str, ssh_cmd: list[str] | None = None) -> str:
    """The IP address of ``host`` (``user@host:port`` works), or the name if it does not resolve.

    With ``ssh_cmd``, an ssh-config alias is first turned into its ``HostName`` (``ssh -G``).
    """
    name = host.split("@", 1)[-1].split(":", 1)[0]
    if ssh_cmd:
        try:
            out = procs.run_command([*ssh_cmd, "-G", host.split(":", 1)[0]], capture_output=True,
                                    text=True, timeout=10).stdout
            name = next((line.split(None, 1)[1] for line in out.splitlines()
                         if line.lower().startswith("hostname ")), name)
        except (OSError, subprocess.TimeoutExpired, IndexError):
            log.debug("ssh -G %s failed", host, exc_info=True)
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def log_dir() -> str:
    """Where the output of a failed start is kept (owner-only)."""
    path = os.environ.get("DDPLAB_LOG_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ddplab", "logs")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def keep_log(engines: str, text: str) -> str:
    """Write a failed start's output to a new file in ``log_dir()``; its path."""
    path = os.path.join(log_dir(), f"start-{engines}-{time.strftime('%Y%m%d-%H%M%S')}-"
                                   f"{secrets.token_hex(2)}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


@dataclass
class HostEngines:
    """How ddplab starts the engines of one multi-host lab, and what it started."""
    engines: str
    counts: dict[str, int] | None
    listen: str
    location: str
    ssh_cmd: list[str] | None
    remote_python: str
    config: dict | None
    cluster: Any = field(default=None, repr=False)    # ipyparallel Cluster, once started

    def configure(self, profile_dir: str, spec: LabSpec) -> Any:
        """An ipyparallel Cluster (not started): our controller, engines by ipyparallel's launcher."""
        import ipyparallel as ipp
        classes = {"ssh": ssh.SSHEngineSetLauncher, "slurm": batch.SlurmEngineSetLauncher,
                   "mpi": batch.MPIEngineSetLauncher}
        cluster = ipp.Cluster(
            engines=classes[self.engines], n=spec.world_size, profile_dir=profile_dir,
            cluster_id="lab", log_level=logging.ERROR, controller_ip=self.listen,
            controller_location=self.location, delay=0,
            engine_timeout=max(REMOTE_ENGINE_TIMEOUT, int(spec.start_timeout)),
            # ddplab stops what it started (stop()); ipyparallel's exit handler and its
            # cluster file would write into the lab's directory after it was removed.
            shutdown_atexit=False, cluster_file="",
            # The engines read the connection file in their own directory, never the key
            # from an environment (a batch system keeps a job's environment).
            send_engines_connection_env=False,
            controller_args=[*heartbeat_args(), *security_args()])
        c = cluster.config
        # The controller ends, and removes the lab's directory, when the kernel dies.
        c.LocalControllerLauncher.controller_cmd = [sys.executable, *_TETHERED, "ipyparallel.controller"]
        c.LocalControllerLauncher.environment = {"DDPLAB_PARENT_PID": str(os.getpid()),
                                                 "DDPLAB_CLEANUP_DIR": profile_dir}
        launcher = _LAUNCHER_CLASS[self.engines]
        # The tether preloads torch; no parent watch: the kernel is not the parent there.
        c[launcher].engine_cmd = [self.remote_python, *_TETHERED, "ipyparallel.engine"]
        # As a local lab's: an engine waits for the controller's answer as long as the start waits.
        c[launcher].engine_args = [f"--IPEngine.max_heartbeat_misses={ENGINE_MISSES}",
                                   f"--IPEngine.timeout={cluster.engine_timeout}"]
        c[launcher].environment = {"DDPLAB_PRELOAD": "torch", "OMP_NUM_THREADS": str(
            omp_threads(max(self.counts.values()) if self.counts else 1))}
        if spec.debug:
            c[launcher].environment["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        if self.engines != "ssh":
            # What a rank writes in its temporary folder goes with the lab's directory, even
            # when the rank is killed (the SSH agent gives its engines a directory of their own).
            c[launcher].environment["TMPDIR"] = profile_dir
        if self.engines == "ssh":
            c.SSHEngineSetLauncher.engines = dict(self.counts)
            c.SSHEngineSetLauncher.remote_python = self.remote_python
            if self.ssh_cmd:
                c.SSHEngineSetLauncher.ssh_cmd = list(self.ssh_cmd)
        if self.engines == "slurm":
            # Into the lab's directory, not the notebook's working directory.
            c.SlurmEngineSetLauncher.batch_file_name = os.path.join(profile_dir, "slurm_engine.sbatch")
        for section, values in (self.config or {}).items():
            c[section].update(values)
        if self.engines == "mpi":
            # mpiexec ends, and its ranks with it, when the kernel dies.
            c.MPIEngineSetLauncher.mpi_cmd = batch.watched(
                list(c.MPIEngineSetLauncher.get("mpi_cmd", ["mpiexec"])))
        return cluster

    @property
    def controller_pid(self) -> int | None:
        """The pid of the controller this launch started here (None before or after)."""
        controller = self.cluster.controller if self.cluster is not None else None
        return None if controller is None else controller.pid

    def start(self, profile_dir: str, spec: LabSpec) -> Any:
        """Start the controller and the engines; a Client once all ``world_size`` registered.

        Raises ``DdplabError`` with the cause as soon as an engine, the job or
        mpiexec ended (or ssh failed), and after ``spec.start_timeout`` s otherwise.
        """
        self.cluster = cluster = self.configure(profile_dir, spec)
        n, client = spec.world_size, None
        try:
            try:
                cluster.start_cluster_sync(n=n)
            except DdplabError as e:
                path = keep_log(self.engines, f"{e}\n")
                raise DdplabError(f"{e}\n(kept in {path}). Fix that and start again.") from e
            except Exception as e:
                raise DdplabError(f"ddplab: starting the {self.engines} engines failed: {e}") from e
            client = cluster.connect_client_sync()
            self._wait_for_engines(client, n, spec.start_timeout)
        except BaseException:
            if client is not None:
                client.close()
            raise
        return client

    @property
    def local_pids(self) -> list[int]:
        """The processes this launch keeps on this machine: the controller, and what holds the
        engines (an ssh session per host, or mpiexec's watcher; a Slurm job holds none here)."""
        pids = [self.controller_pid] if self.controller_pid else []
        es = self.engine_set
        if self.engines == "ssh" and es is not None:
            pids += [s.proc.pid for s in es.sessions]
        elif getattr(es, "pid", None):
            pids.append(es.pid)
        return pids

    @property
    def engine_set(self) -> Any:
        """ipyparallel's engine launcher of this launch (None before start)."""
        sets = list(self.cluster.engines.values()) if self.cluster is not None else []
        return sets[0] if sets else None

    def _failure(self) -> str | None:
        controller = self.cluster.controller
        if controller is not None and controller.pid > 0 and not procs.alive(controller.pid):
            return f"the controller exited. Its output:\n{controller.get_output().rstrip()}"
        es = self.engine_set
        if es is None:
            return None
        if self.engines == "ssh":
            return es.failure()
        return batch.failure(es, self.engines)

    def _wait_for_engines(self, client: Any, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(client.ids) < n:
            why = self._failure()
            if why:
                path = keep_log(self.engines, why + "\n")
                raise DdplabError(f"ddplab: the {self.engines} engines cannot start: {why}\n"
                                  f"(kept in {path}). Fix that and start again.")
            if time.monotonic() > deadline:
                es = self.engine_set
                state = batch.waiting_on(es, self.engines) if es is not None else ""
                raise DdplabError(f"ddplab: {len(client.ids)} of {n} {self.engines} engines "
                                  f"registered within {timeout:g} s{'; ' + state if state else ''}. "
                                  f"Start with a longer timeout=, or fewer ranks.")
            time.sleep(0.1)

    def stop(self) -> None:
        """End the engines on every host, the controller, and remove what they wrote."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            return
        for es in list(cluster.engines.values()):
            try:
                if self.engines == "ssh":
                    es.stop_sync()
                elif self.engines == "slurm":
                    batch.stop_job(es)
                else:
                    batch.stop_mpiexec(es)
            except Exception:
                log.warning("ddplab: stopping the %s engines failed", self.engines, exc_info=True)
            if self.engines == "slurm" and es.batch_file:
                _remove(es.batch_file)
        cluster.engines.clear()
        controller, cluster.controller = cluster.controller, None
        if controller is not None and controller.pid > 0:
            procs.end_tree(controller.pid, grace=5)
            popen = getattr(controller, "_popen_process", None)
            try:
                if popen is not None:
                    popen.wait(5)
            except Exception:
                log.debug("the controller did not exit", exc_info=True)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def plan(world_size: int, *, hosts: Any = None, engines: str | None = None,
         listen: str | None = None, ssh_cmd: list[str] | None = None,
         remote_python: str | None = None, config: dict | None = None) -> tuple[HostEngines, list[str]]:
    """Check the arguments of ``start(hosts=...)`` / ``engines=``; the launch and the host order.

    ``remote_python`` defaults to this kernel's Python (``sys.executable``): the hosts
    share its file system, as on most clusters. Raises ``ConfigError`` naming the fix
    before anything starts.
    """
    engines = engines or ("ssh" if hosts is not None else None)
    if engines not in ENGINE_LAUNCHERS:
        raise ConfigError(f"ddplab: engines={engines!r} is not a launcher ddplab uses. Use one "
                          f"of {', '.join(map(repr, ENGINE_LAUNCHERS))}, or hosts=[...] for ssh.")
    counts = split_hosts(hosts, world_size) if hosts is not None else None
    if engines == "ssh" and not counts:
        raise ConfigError("ddplab: engines='ssh' needs the hosts to start them on. "
                          "Use hosts=['node1', 'node2'].")
    if isinstance(ssh_cmd, str):
        raise ConfigError(f"ddplab: ssh_cmd={ssh_cmd!r} is one string; it takes a list. "
                          f"Use ssh_cmd={ssh_cmd.split()!r}.")
    remote_python = remote_python or sys.executable
    if engines == "mpi":
        batch.check_mpi(remote_python, config)
    order = [address(h, list(ssh_cmd or ["ssh"])) for h in counts] if counts else []
    if listen is None:
        try:
            listen = placing.local_address(order[0]) if order else "*"
        except OSError as e:
            raise ConfigError(f"ddplab: cannot find the address that reaches host {order[0]!r} "
                              f"({e}). Check the name, or pass listen='this machine's address'.") from e
    location = socket.gethostname() if listen in ("*", "0.0.0.0") else listen
    launch = HostEngines(engines=engines, counts=counts, listen=listen, location=location,
                    ssh_cmd=list(ssh_cmd) if ssh_cmd else None, remote_python=remote_python,
                    config=config)
    return launch, order
