"""``HostRanks``: a lab's ranks on several hosts (the ``Ranks`` interface).

ddplab builds no cluster manager. ipyparallel already starts engines over SSH,
MPI, Slurm and more (``ddplab.lab.multihost.start`` configures, starts and stops
them); torch.distributed already joins ranks across hosts. This module only
connects the two::

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
  misses them (``ddplab.lab.ranks.HEARTBEAT_LOSS_S``, 3 s, with ddplab's own
  controller), and the next call, or the one waiting, raises
  ``EngineDiedError`` naming the host and its ranks.
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

import logging
import re
import signal
import sys
import tempfile
import time
from typing import Any, Callable

from ipyparallel.error import EngineError, RemoteError

from ... import hosts as placing
from ...env import choose_host_backend
from ...errors import ConfigError, DdplabError, EngineDiedError
from ...rank import engine
from ...text import plural
from ..ranks import HEARTBEAT_LOSS_S, EngineSet, Joins, LabSpec, Loss
from .start import HostEngines

log = logging.getLogger(__name__)

#: How long to wait for the heartbeat's verdict once gloo says a peer hung up.
LOSS_WAIT = 2 * HEARTBEAT_LOSS_S
#: After a first lost rank, how long to wait for the rest of its host to be
#: declared lost too (a heartbeat period or so apart).
_SETTLE_S = 4.0
_LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket Timeout")


class _Result:
    """An AsyncResult whose loss of an engine becomes ``EngineDiedError`` naming the host."""

    def __init__(self, ranks: "HostRanks", result: Any) -> None:
        self._ranks, self._result = ranks, result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)      # everything else is the AsyncResult's

    def ready(self) -> bool:
        return self._result.ready()

    def wait(self, timeout: float | None = None) -> bool:
        return self._result.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        try:
            return self._result.get(timeout)
        except (EngineError, RemoteError) as e:
            if not _engine_lost(e):
                raise
            loss = self._ranks.lost(wait=5.0)   # the hub told us first: say which host
            if loss is None:
                raise
            raise EngineDiedError(f"ddplab: {loss.reason} Recover with: {loss.recovery}",
                                  loss.ranks, reason=loss.reason) from e


class HostRanks:
    """Ranks on engines that may run on other hosts; see this module's docstring.

    Give ``launch`` (``launch.plan``) for engines ddplab starts, or
    ``connect`` (returns an ipyparallel ``Client``) for engines you started.
    """

    def __init__(self, spec: LabSpec, *, connect: Callable[[], Any] | None = None,
                 launch: HostEngines | None = None, host_order: list[str] = ()) -> None:
        self.spec = spec
        self._connect, self._launch = connect, launch
        self._host_order = list(host_order)
        self.backend, self.backend_reason = "gloo", "gloo"   # chosen per host once formed
        self.running = False
        self.directory = ""
        self.placements: list[placing.Placement] = []
        #: The ipyparallel client and each rank's engine (None while stopped).
        self.engine_set: EngineSet | None = None
        self._described: dict[int, placing.Engine] = {}

    # ------------------------------------------------------------- state
    @property
    def world_size(self) -> int:
        return len(self.placements) or self.spec.world_size

    @property
    def pids(self) -> list[int]:
        return [self._described[eid].pid for eid in self._engine_ids()]

    @property
    def controller_pid(self) -> int | None:
        return None if self._launch is None else self._launch.controller_pid

    @property
    def local_pids(self) -> list[int]:
        """The processes ddplab runs on this machine for these engines (see ``HostEngines``);
        none for engines you started and attached to."""
        return [] if self._launch is None else self._launch.local_pids

    @property
    def hosts(self) -> list[dict]:
        """One entry per host, in node-rank order: address, hostname, ranks."""
        out = []
        for p in self.placements:
            if p.local_rank == 0:
                e = self._described[p.engine_id]
                out.append({"node_rank": p.node_rank, "address": p.host,
                            "hostname": e.hostname, "ranks": []})
            out[-1]["ranks"].append(p.rank)
        return out

    def rank_directory(self, rank: int) -> str:
        """The private directory rank ``rank`` made on its host (its stack dumps)."""
        return self._described[self._engine_ids()[rank]].tmpdir

    def describe(self) -> str:
        names = ", ".join(f"{h['address']} ({len(h['ranks'])})" for h in self.hosts)
        return (f"{self.world_size} {plural(self.world_size, 'rank')} ready on {len(self.hosts)} "
                f"{plural(len(self.hosts), 'host')} [{names}], "
                f"backend {self.backend_reason}.")

    def _engine_ids(self) -> list[int]:
        return self.engine_set.engine_ids if self.engine_set is not None else []

    # ------------------------------------------------------------- forming
    def bring_up(self) -> Joins:
        """Start the engines (or connect to yours), place the ranks; the joins that form the group."""
        self.directory = tempfile.mkdtemp(prefix="ddplab-")   # mode 0700: only we can read it
        self.running = True
        client = (self._launch.start(self.directory, self.spec) if self._launch is not None
                  else self._connect())
        asked, timeout = self.spec.world_size, self.spec.start_timeout
        client.wait_for_engines(asked or 1, timeout=timeout, interactive=False)
        ids = sorted(client.ids)
        if asked and len(ids) < asked:
            client.close()
            raise ConfigError(f"ddplab: world_size={asked}, but the cluster has only {len(ids)} "
                              f"engines. Start more engines or ask for world_size={len(ids)}.")
        ids = ids[:asked] if asked else ids
        self.engine_set = EngineSet(client, ids)
        controller_ip = _url_host(client._config["registration"])
        probe = dict(zip(ids, self.engine_set.apply(list(range(len(ids))), _prepare, controller_ip)))
        try:
            info = {eid: r.get(timeout) for eid, r in probe.items()}
        except Exception as e:
            raise DdplabError(
                f"ddplab: the engines did not answer within start_timeout={timeout:g} s ({e}). They may "
                f"be busy with an earlier group's collective. Restart them (ipcluster engines, or "
                f"your job script) and attach again.") from e
        self._described = {eid: placing.Engine(eid, **d) for eid, d in info.items()}
        self.placements = placing.place(list(self._described.values()), self._host_order)
        self.backend, self.backend_reason = choose_host_backend(
            self.spec.backend, [(p.host, p.local_world_size, self._described[p.engine_id].gpus)
                                for p in self.placements if p.local_rank == 0])
        # Ranks in placement order: rank r runs on the engine placed at r.
        self.engine_set = EngineSet(client, [p.engine_id for p in self.placements])
        return self._joins()

    def _joins(self) -> Joins:
        n, timeout, pg_timeout = self.world_size, self.spec.start_timeout, self.spec.pg_timeout
        master = self.placements[0].host
        port = self.apply([0], engine.open_store, master, n, pg_timeout)[0].get(timeout)
        joins = {}
        for p in self.placements:
            e = self._described[p.engine_id]
            env = placing.rank_env(p, master, port, e.ifname)
            joins[p.rank] = (p.rank, n, env, self.backend, pg_timeout, f"{e.tmpdir}/stack.txt",
                             [path for path in sys.path if path])
        return joins

    def formed(self) -> None:
        """Nothing to note once the group formed."""

    # ------------------------------------------------------------- running
    def apply(self, ranks: list[int], fn: Callable, *args: Any) -> list[Any]:
        return [_Result(self, r) for r in self.engine_set.apply(ranks, fn, *args)]

    def _lost_ranks(self) -> list[int]:
        alive = self.engine_set.registered() if self.engine_set is not None else set()
        return [rank for rank, eid in enumerate(self._engine_ids()) if eid not in alive]

    def _whole_hosts(self, dead: list[int]) -> bool:
        """Whether every host with a lost rank has lost all its ranks."""
        return all(set(h["ranks"]) <= set(dead) for h in self.hosts
                   if set(h["ranks"]) & set(dead))

    def lost(self, wait: float = 0.0) -> Loss | None:
        """The ranks whose engines the controller lost, named by host."""
        deadline = time.monotonic() + wait
        dead = self._lost_ranks()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.1)
            dead = self._lost_ranks()
        if not dead:
            return None
        # The hub notices each engine on its own heartbeat, so a host's engines,
        # killed together, are reported one period apart: let the rest of that
        # host catch up, so the message names every rank it lost.
        settle = time.monotonic() + _SETTLE_S
        while time.monotonic() < settle and not self._whole_hosts(dead):
            time.sleep(0.1)
            dead = self._lost_ranks()
        parts = []
        for h in self.hosts:
            gone = [r for r in h["ranks"] if r in dead]
            if gone:
                whole = "all its ranks" if len(gone) == len(h["ranks"]) else "ranks"
                parts.append(f"host {h['address']} (node {h['node_rank']}): "
                             f"{whole} {', '.join(map(str, gone))}")
        reason = ("lost " + "; ".join(parts) + ". The controller stopped hearing from "
                  "their engines (killed, out of memory, host down or link down).")
        return Loss(dead, reason, "lab.restart() once the host is back")

    def confirm_loss(self, failures: dict[int, str]) -> Loss | None:
        # gloo saying a peer hung up means a process or a link is gone: give the
        # controller's heartbeat the time to confirm, and name the host it lost.
        if any(_LOST_PEER.search(text) for text in failures.values()):
            return self.lost(wait=min(self.spec.timeout, LOSS_WAIT))
        return None

    def frames(self, ranks: list[int], deadline: float) -> dict[int, list]:
        return {}                   # signals do not cross hosts: stacks are out of reach

    def out_of_reach(self, rank: int) -> str:
        # Signals do not cross hosts, so a stuck rank's stack is out of reach.
        return (f"running on host {self.placements[rank].host} (its stack cannot be read from "
                f"here)")

    def collectives(self, ranks: list[int], deadline: float) -> dict[int, list[dict]]:
        return {}                   # the recorder's answer lives on the other host

    def cpu_seconds(self, ranks: list[int]) -> dict[int, float]:
        return {}                   # the processes are on the other host

    def recorded(self, ranks: list[int], deadline: float) -> dict[int, dict]:
        return {}                   # the trace of a stuck rank stays on the other host

    def interrupt(self, ranks: list[int]) -> None:
        # Through the engines' nanny: our signals do not reach other hosts.
        ids = [self._engine_ids()[r] for r in ranks]
        try:
            self.engine_set.client.send_signal(signal.SIGINT, ids, block=False)
        except Exception:
            log.debug("SIGINT through the nanny of engines %s failed", ids, exc_info=True)

    # ------------------------------------------------------------- ending
    def replace(self) -> Joins | None:
        """Engines on other hosts are placed afresh at every start: restart re-forms the lab."""
        return None

    def shut_down(self) -> None:
        """Leave the group on every engine; stop the engines only if this lab started them."""
        import shutil
        engines, self.engine_set = self.engine_set, None
        self.running = False
        try:
            if engines is not None:
                alive = engines.registered()
                # Attached engines stay yours: leave the group and clean up, if they answer.
                tmp = [(eid, e.tmpdir) for eid, e in self._described.items() if eid in alive]
                results = [engines.client[eid].apply_async(_leave, d) for eid, d in tmp]
                for result in results:
                    try:
                        result.get(2)
                    except Exception:
                        log.debug("an engine did not leave its group", exc_info=True)
                engines.close()
            if self._launch is not None:
                self._launch.stop()
        finally:
            if self.directory:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = ""


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
def _engine_lost(error: Exception) -> bool:
    """Whether ipyparallel says an engine is gone: it raises ``EngineError`` while waiting
    for engines, and reports a task whose engine died as a ``RemoteError`` carrying one."""
    return isinstance(error, EngineError) or getattr(error, "ename", "") == "EngineError"


def _url_host(url: str) -> str:
    """``tcp://10.0.0.1:5555`` -> ``10.0.0.1``."""
    host = url.split("://", 1)[-1].rsplit(":", 1)[0]
    return "127.0.0.1" if host in ("*", "0.0.0.0", "") else host
