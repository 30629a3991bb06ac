"""Starting and stopping engines on other hosts, through ipyparallel's own launchers.

``ddplab.lab.multihost`` forms a group over engines; this module is how those
engines come to exist when ddplab starts them (``start(hosts=...)`` over SSH,
``engines="slurm"``, ``engines="mpi"``): the arguments checked, ipyparallel's
``Cluster`` configured, started and, at the end, stopped with everything it
started. ``attach`` never comes here: engines you started stay yours.

The one seam ``multihost`` uses: ``plan(...)`` checks the arguments and returns
a ``Launch``; ``Launch.start(profile_dir, spec)`` starts the controller and the
engines and returns a connected ``Client``; ``Launch.stop()`` ends them.
"""

from __future__ import annotations

import logging
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from .. import hosts as placing
from ..env import omp_threads
from ..errors import ConfigError
from .ranks import LabSpec, heartbeat_args

log = logging.getLogger(__name__)

#: Launchers ``start(engines=...)`` accepts: ipyparallel's own names.
ENGINE_LAUNCHERS = ("ssh", "mpi", "slurm")
_LAUNCHER_CLASS = {"ssh": "SSHEngineSetLauncher", "mpi": "MPIEngineSetLauncher",
                   "slurm": "SlurmEngineSetLauncher"}


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


def address(host: str) -> str:
    """The IP address of ``host`` (``user@host:port`` works), or the name if it does not resolve."""
    name = host.split("@", 1)[-1].split(":", 1)[0]
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


@dataclass
class Launch:
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
        cluster = ipp.Cluster(
            engines=self.engines, n=spec.world_size, profile_dir=profile_dir, cluster_id="lab",
            log_level=logging.ERROR, controller_ip=self.listen,
            controller_location=self.location, delay=0,
            engine_timeout=max(120, int(spec.timeout)),
            controller_args=[*heartbeat_args(), *security_args()])
        c = cluster.config
        launcher = _LAUNCHER_CLASS[self.engines]
        # The guard preloads torch; no parent watch: the kernel is not the parent there.
        c[launcher].engine_cmd = [self.remote_python, "-m", "ddplab.rank.guard",
                                  "ipyparallel.engine"]
        c[launcher].environment = {"DDPLAB_PRELOAD": "torch", "OMP_NUM_THREADS": str(
            omp_threads(max(self.counts.values()) if self.counts else 1))}
        if spec.debug:
            c[launcher].environment["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        if self.engines == "ssh":
            c.SSHEngineSetLauncher.engines = dict(self.counts)
            c.SSHEngineSetLauncher.remote_python = self.remote_python
            if self.ssh_cmd:
                c.SSHEngineSetLauncher.ssh_cmd = list(self.ssh_cmd)
                c.SSHEngineLauncher.ssh_cmd = list(self.ssh_cmd)
        for section, values in (self.config or {}).items():
            c[section].update(values)
        return cluster

    @property
    def controller_pid(self) -> int | None:
        """The pid of the controller this launch started here (None before or after)."""
        controller = self.cluster.controller if self.cluster is not None else None
        return None if controller is None else controller.pid

    def start(self, profile_dir: str, spec: LabSpec) -> Any:
        """Start the controller and the engines; a connected ipyparallel ``Client``."""
        self.cluster = self.configure(profile_dir, spec)
        self.cluster.start_cluster_sync(n=spec.world_size)
        return self.cluster.connect_client_sync()

    def stop(self) -> None:
        """End the engines and the controller this launch started (on every host)."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            return
        try:
            cluster.stop_cluster_sync()
        except Exception:
            log.debug("stopping the multi-host cluster failed", exc_info=True)


def plan(world_size: int, *, hosts: Any = None, engines: str | None = None,
         listen: str | None = None, ssh_cmd: list[str] | None = None,
         remote_python: str = "python3", config: dict | None = None) -> tuple[Launch, list[str]]:
    """Check the arguments of ``start(hosts=...)`` / ``engines=``; the launch and the host order.

    Raises ``ConfigError`` naming the fix before anything starts.
    """
    engines = engines or ("ssh" if hosts is not None else None)
    if engines not in ENGINE_LAUNCHERS:
        raise ConfigError(f"ddplab: engines={engines!r} is not a launcher ddplab uses. Use one "
                          f"of {', '.join(map(repr, ENGINE_LAUNCHERS))}, or hosts=[...] for ssh.")
    counts = split_hosts(hosts, world_size) if hosts is not None else None
    if engines == "ssh" and not counts:
        raise ConfigError("ddplab: engines='ssh' needs the hosts to start them on. "
                          "Use hosts=['node1', 'node2'].")
    order = [address(h) for h in counts] if counts else []
    if listen is None:
        listen = placing.local_address(order[0]) if order else "*"
    location = socket.gethostname() if listen in ("*", "0.0.0.0") else listen
    launch = Launch(engines=engines, counts=counts, listen=listen, location=location,
                    ssh_cmd=ssh_cmd, remote_python=remote_python, config=config)
    return launch, order
