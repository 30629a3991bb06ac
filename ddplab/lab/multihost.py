"""Labs whose ranks live on several hosts, through ipyparallel's own launchers.

ddplab builds no cluster manager. ipyparallel already starts engines over SSH,
MPI, Slurm and more; torch.distributed already joins ranks across hosts. This
module only connects the two::

    lab = ddplab.start(world_size=4, hosts=["node1", "node2"])   # 2 ranks per host, over SSH
    lab = ddplab.start(world_size=8, engines="slurm")            # sbatch starts the engines
    lab = ddplab.attach(profile="mycluster")                     # engines you started: ipcluster start ...

How a multi-host lab forms
--------------------------
1. A Client connects to the controller (ours, or yours with ``attach``).
2. Every engine reports the address its host uses to reach the controller,
   its hostname, its network interface and its GPU count (``hosts.describe_engine``).
3. Ranks are ordered by host, then local rank (``hosts.place``): hosts in the
   order you listed them, else by address; engines of one host by id.
4. Rank 0 opens the TCPStore on *its host's address* (not 0.0.0.0). A local
   lab meets in an owner-only FileStore instead; a file cannot span hosts
   (short of a shared file system), so here the store listens. Every rank
   gets torchrun's variables, MASTER_ADDR = that address, LOCAL_RANK and
   LOCAL_WORLD_SIZE per host, GLOO_SOCKET_IFNAME = the interface that carries
   the hosts' addresses. With nccl each rank takes GPU LOCAL_RANK of its host.

Failure modes
-------------
- A host's engines die or its link goes down: the controller's heartbeat
  misses them (about ``period x 10``; ddplab's own controller pings every
  0.5 s), and the next call, or the one waiting, raises ``EngineDiedError``
  naming the host and its ranks.
- Signals cannot cross hosts: ``HangError`` says where a stuck rank is only
  for ranks whose stack ddplab can read; Kernel > Interrupt goes through
  ipyparallel's nanny (on by default in ``ipcluster``).

Security
--------
Nothing listens beyond 127.0.0.1 unless you pass ``hosts=``/``engines=`` or
attach. ddplab's controller then listens on the one address that faces your
hosts (``listen=`` to choose), with CurveZMQ encryption on *and* message
signing kept on (ipyparallel turns signing off under Curve unless a key is
set; ddplab sets one). Rank 0's TCPStore listens on rank 0's address, and
gloo's connections are plain TCP between the hosts: use a private network.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import replace
from typing import Any

from .. import hosts as placing
from ..env import check_timeout, check_world_size, choose_host_backend
from ..errors import ConfigError, DdplabError, EngineDiedError
from ..rank import engine
from . import cluster, display, hostlaunch, magics
from .cluster import Lab, LabSpec, Task
from .ranks import HEARTBEAT_LOSS_S

#: How long to wait for that heartbeat verdict once gloo says a peer hung up.
LOSS_WAIT = 2 * HEARTBEAT_LOSS_S
#: After a first lost rank, how long to wait for the rest of its host to be
#: declared lost too (a heartbeat period or so apart; 3 s is ipcluster's period).
_SETTLE_S = 4.0
_LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket Timeout")


class _Result:
    """An AsyncResult whose loss of an engine becomes ``EngineDiedError`` naming the host."""

    def __init__(self, lab: "HostLab", result: Any) -> None:
        self._lab, self._result = lab, result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)      # everything else is the AsyncResult's

    def ready(self) -> bool:
        return self._result.ready()

    def wait(self, timeout: float | None = None) -> bool:
        return self._result.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        try:
            return self._result.get(timeout)
        except Exception as e:
            if "EngineError" not in repr(e):
                raise
            self._lab._check_alive(wait=5.0)     # the hub told us first: say which host
            raise


class HostLab(Lab):
    """A lab whose ranks may run on other hosts. Make one with ``start(hosts=...)`` or ``attach``."""

    # Engines on other hosts are placed afresh at every start: restart re-forms the whole lab.
    restart_keeps_controller = False

    def __init__(self, spec: LabSpec, *, connect=None, launch: hostlaunch.Launch | None = None,
                 host_order: list[str] = ()) -> None:
        super().__init__(replace(spec, backend="gloo"), 0)   # the backend is chosen per host later
        self.spec, self._asked = spec, spec
        self._connect, self._launch = connect, launch
        self._host_order = list(host_order)
        self.placements: list[placing.Placement] = []
        self._engines: dict[int, placing.Engine] = {}

    # ------------------------------------------------------------- forming
    def _bring_up(self) -> None:
        self._client = (self._launch.start(self._dir, self._asked) if self._launch is not None
                        else self._connect())
        self._cluster = self._client            # "running" means: we hold a connection
        self._form()

    def _form(self) -> None:
        client, asked, timeout = self._client, self._asked.world_size, self.spec.timeout
        client.wait_for_engines(asked or 1, timeout=max(timeout, 60), interactive=False)
        ids = sorted(client.ids)
        if asked and len(ids) < asked:
            raise ConfigError(f"ddplab: world_size={asked}, but the cluster has only {len(ids)} "
                              f"engines. Start more engines or ask for world_size={len(ids)}.")
        ids = ids[:asked] if asked else ids
        client[ids].use_cloudpickle()
        controller_ip = _url_host(client._config["registration"])
        probe = {eid: client[eid].apply_async(_prepare, controller_ip) for eid in ids}
        try:
            info = {eid: r.get(timeout) for eid, r in probe.items()}
        except Exception as e:
            raise DdplabError(
                f"ddplab: the engines did not answer within timeout={timeout:g} s ({e}). They may "
                f"be busy with an earlier group's collective. Restart them (ipcluster engines, or "
                f"your job script) and attach again.") from e
        self._engines = {eid: placing.Engine(eid, **d) for eid, d in info.items()}
        self.placements = placing.place(list(self._engines.values()), self._host_order)
        n = len(self.placements)
        self.spec = replace(self.spec, world_size=n)
        self.backend, self.backend_reason = choose_host_backend(
            self._asked.backend, [(p.host, p.local_world_size, self._engines[p.engine_id].gpus)
                                  for p in self.placements if p.local_rank == 0])
        self._engine_ids = [p.engine_id for p in self.placements]
        self._pids = [self._engines[eid].pid for eid in self._engine_ids]
        self._join_group()

    def _join_group(self) -> None:
        n, timeout, pg_timeout = self.world_size, self.spec.timeout, self.spec.pg_timeout
        master = self.placements[0].host
        port = self._call(0, engine.open_store, master, n, pg_timeout).get(timeout)
        tasks = []
        for p in self.placements:
            e = self._engines[p.engine_id]
            env = placing.rank_env(p, master, port, e.ifname)
            args = (p.rank, n, env, self.backend, pg_timeout, f"{e.tmpdir}/stack.txt",
                    [path for path in sys.path if path])
            tasks.append(Task(p.rank, self._call(p.rank, engine.call, engine.join_group, args, {})))
        self._await_join(tasks, timeout)

    # ------------------------------------------------------------- watching
    @property
    def hosts(self) -> list[dict]:
        """One entry per host, in node-rank order: address, hostname, ranks."""
        out = []
        for p in self.placements:
            if p.local_rank == 0:
                e = self._engines[p.engine_id]
                out.append({"node_rank": p.node_rank, "address": p.host,
                            "hostname": e.hostname, "ranks": []})
            out[-1]["ranks"].append(p.rank)
        return out

    def _lost(self) -> list[int]:
        alive = set(self._client.ids) if self._client is not None else set()
        return [rank for rank, eid in enumerate(self._engine_ids) if eid not in alive]

    def _whole_hosts(self, dead: list[int]) -> bool:
        """Whether every host with a lost rank has lost all its ranks."""
        return all(set(h["ranks"]) <= set(dead) for h in self.hosts
                   if set(h["ranks"]) & set(dead))

    def _check_alive(self, wait: float = 0.0) -> None:
        """Raise EngineDiedError naming the host(s) whose engines the controller lost."""
        deadline = time.monotonic() + wait
        dead = self._lost()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.1)
            dead = self._lost()
        if not dead:
            return
        # The hub notices each engine on its own heartbeat, so a host's engines,
        # killed together, are reported one period apart: let the rest of that
        # host catch up, so the message names every rank it lost.
        settle = time.monotonic() + _SETTLE_S
        while time.monotonic() < settle and not self._whole_hosts(dead):
            time.sleep(0.1)
            dead = self._lost()
        parts = []
        for h in self.hosts:
            gone = [r for r in h["ranks"] if r in dead]
            if gone:
                whole = "all its ranks" if len(gone) == len(h["ranks"]) else "ranks"
                parts.append(f"host {h['address']} (node {h['node_rank']}): "
                             f"{whole} {', '.join(map(str, gone))}")
        self._broken = ("lost " + "; ".join(parts) + ". The controller stopped hearing from "
                        "their engines (killed, out of memory, host down or link down).")
        raise EngineDiedError(f"ddplab: {self._broken} Recover with: lab.restart() once the "
                              f"host is back", dead)

    def _confirm_loss(self, failures) -> None:
        # gloo saying a peer hung up means a process or a link is gone: give the
        # controller's heartbeat the time to confirm, and name the host it lost.
        if any(_LOST_PEER.search(text) for text in failures.values()):
            self._check_alive(wait=min(self.spec.timeout, LOSS_WAIT))

    def _wrap(self, result):
        return _Result(self, result)

    def _frames(self, tasks, deadline):
        return {}                   # signals do not cross hosts: stacks are out of reach

    def _locate(self, tasks, deadline):
        # Signals do not cross hosts, so a stuck rank's stack is out of reach.
        where = {t.rank: f"running on host {self.placements[t.rank].host} (its stack cannot be "
                 f"read from here)" for t in tasks}
        return where, {}

    def _send_interrupt(self, ranks) -> None:
        # Through the engines' nanny: our signals do not reach other hosts.
        try:
            self._client.send_signal(signal.SIGINT, [self._engine_ids[r] for r in ranks],
                                     block=False)
        except Exception:
            pass

    # ------------------------------------------------------------- ending
    def _shut_down(self) -> None:
        """Close our connection; stop the engines only if this lab started them."""
        client, self._client, self._cluster = self._client, None, None
        if client is not None:
            alive = set(client.ids)
            # Attached engines stay yours: leave the group and clean up, if they answer.
            tmp = [(eid, e.tmpdir) for eid, e in self._engines.items() if eid in alive]
            results = [client[eid].apply_async(_leave, d) for eid, d in tmp]
            for r in results:
                try:
                    r.get(2)
                except Exception:
                    pass
            client.close()
        if self._launch is not None:
            self._launch.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = ", ".join(f"{h['address']}: ranks {h['ranks']}" for h in self.hosts)
        return (f"<ddplab.HostLab world_size={self.world_size} backend={self.backend!r} "
                f"{state} hosts=[{where}]>")


# ------------------------------------------------------------- on the engines
def _prepare(controller_ip: str) -> dict:
    """On an engine: leave any earlier group, forget an old store, describe the host."""
    from ddplab.rank import engine as eng
    eng.leave_group()
    return placing.describe_engine(controller_ip)


def _leave(tmpdir: str) -> None:
    import shutil as sh

    from ddplab.rank import engine as eng
    eng.leave_group()
    sh.rmtree(tmpdir, ignore_errors=True)


# ------------------------------------------------------------- on the kernel
def _url_host(url: str) -> str:
    """``tcp://10.0.0.1:5555`` -> ``10.0.0.1``."""
    host = url.split("://", 1)[-1].rsplit(":", 1)[0]
    return "127.0.0.1" if host in ("*", "0.0.0.0", "") else host


def start_hosts(world_size: int, backend: str = "auto", timeout: float = 60, *,
                hosts=None, engines: str | None = None, listen: str | None = None,
                ssh_cmd: list[str] | None = None, remote_python: str | None = None,
                config: dict | None = None, grace: float = 2.0, pg_timeout: float = 1800,
                debug: bool = False) -> HostLab:
    """``ddplab.start(..., hosts=[...])`` / ``engines=``: see this module's docstring.

    - ``hosts``: hostnames (``user@host:port`` works), ranks split evenly, or
      ``{"host": ranks}``. Implies ``engines="ssh"``.
    - ``engines``: ``"ssh"``, ``"mpi"`` or ``"slurm"``: ipyparallel's launcher.
    - ``listen``: the address our controller listens on; by default the one
      this machine uses to reach the first host (for mpi/slurm: all
      interfaces, ``"*"``, since the compute nodes are not known in advance).
    - ``ssh_cmd``: the ssh command, ``["ssh", "-i", "key"]`` for example.
    - ``config``: more launcher settings, ``{"SlurmEngineSetLauncher": {"account": "x"}}``.
    """
    n = check_world_size(world_size)
    launch, order = hostlaunch.plan(n, hosts=hosts, engines=engines, listen=listen,
                                    ssh_cmd=ssh_cmd, remote_python=remote_python, config=config)
    spec = LabSpec(world_size=n, backend=backend, timeout=check_timeout(timeout),
                   grace=check_timeout(grace, "grace", example=2),
                   pg_timeout=check_timeout(pg_timeout, "pg_timeout"), debug=bool(debug))
    lab = HostLab(spec, host_order=order, launch=launch)
    return _make_current(lab)


def attach(url_file: str | None = None, *, profile: str | None = None,
           profile_dir: str | None = None, cluster_id: str | None = None, world_size: int | None = None,
           backend: str = "auto", timeout: float = 60, hosts_order: list[str] = (),
           grace: float = 2.0, pg_timeout: float = 1800, debug: bool = False) -> HostLab:
    """Join a cluster you started (``ipcluster start``, a Slurm job) and form the group over it.

    Give the controller's ``ipcontroller-client.json`` (``url_file``), or a
    ``profile`` and ``cluster_id`` as you gave ``ipcluster``. ``world_size``
    defaults to every engine registered. Your engines keep running after
    ``lab.stop()``; they only leave the process group.
    """
    n = None if world_size is None else check_world_size(world_size)
    spec = LabSpec(world_size=n or 0, backend=backend, timeout=check_timeout(timeout),
                   grace=check_timeout(grace, "grace", example=2),
                   pg_timeout=check_timeout(pg_timeout, "pg_timeout"), debug=bool(debug))
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"ddplab: backend={backend!r} is not one ddplab knows. "
                          f"Use one of 'auto', 'gloo', 'nccl'.")

    def connect():
        import ipyparallel as ipp
        if url_file is not None:
            # A job script may attach while its controller is still writing the file.
            deadline = time.monotonic() + spec.timeout
            while not os.path.exists(url_file) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not os.path.exists(url_file):
                raise ConfigError(f"ddplab: no connection file at {url_file} after "
                                  f"{spec.timeout:g} s. Start the controller first (ipcluster "
                                  f"start / ipcontroller) and give its ipcontroller-client.json.")
            return ipp.Client(url_file)
        kwargs = {k: v for k, v in (("profile", profile), ("profile_dir", profile_dir),
                                    ("cluster_id", cluster_id)) if v is not None}
        return ipp.Client(timeout=spec.timeout, **kwargs)

    lab = HostLab(spec, connect=connect, host_order=[hostlaunch.address(h) for h in hosts_order])
    return _make_current(lab)


def _make_current(lab: HostLab) -> HostLab:
    cluster.stop_current()
    lab.start()
    cluster.make_current(lab)
    names = ", ".join(f"{h['address']} ({len(h['ranks'])})" for h in lab.hosts)
    display.say(f"ddplab: {lab.world_size} ranks ready on {len(lab.hosts)} hosts [{names}], "
                f"backend {lab.backend_reason}.")
    magics.register()
    return lab
