"""``AttachedRanks``: the ranks of a lab someone else started, reached through its controller.

The third ``Ranks`` (beside ``LocalRanks`` and ``HostRanks``), for a process
that must drive another's lab without trusting it: the grading worker
(``ddplab.grade.witness``) runs every check against the ranks of the
submission's lab, not in the submission's kernel, whose ``Lab`` the
submission can patch. ``lab_at(directory, timeout)`` returns a plain ``Lab``
over these ranks, so a checker finds there what it finds on any lab
(``run``, ``spawn``, ``trace``, ``world_size``, output by rank, ``RankError``
and ``HangError``).

What it does, and what it never does:

- connects with the client connection file in the lab's private folder;
- numbers the engines as their lab did: each live engine says which rank
  its lab made it (``debugger.settled_rank``), so a lab of bare ranks that
  has not joined a group yet is numbered as the kernel numbers it, and the
  engines a ``lab.restart()`` killed (the hub lists them for a few
  heartbeats) are left out;
- never forms or leaves a process group, never starts, signals or stops a
  process: ``shut_down`` only closes its client;
- reads nothing but replies: no stack files, flight recorder or side
  channel (a hang is reported without stacks, a stuck trace is cut).

Replies are unpickled by whatever this process installed; the grading worker
installs ``ddplab.grade.unpickle.SafePickle`` (plain data and tensors only),
and a reply it refuses fails the call with ``AssertionError("rank N: ...")``.
Unlike the other ``Ranks``, no ``use_cloudpickle``: that would put cloudpickle
back in this process's place of ``SafePickle``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ..text import plural
from .ranks import Joins, LabSpec, Loss

log = logging.getLogger(__name__)
#: Where a local lab's ranks meet for ``spawn``: their own loopback (grading starts local labs).
SPAWN_HOST = "127.0.0.1"


def _lab_rank() -> int:
    """On an engine: the rank its lab made it, else its torch rank, else -1."""
    from ddplab.rank import debugger
    rank = debugger.settled_rank()
    if rank is not None:
        return rank
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


class _Checked:
    """One rank's reply; a reply this process would not unpickle fails the call."""

    def __init__(self, rank: int, result: Any) -> None:
        self._rank, self._result = rank, result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)

    def get(self, timeout: float | None = None) -> Any:
        outcome = self._result.get(timeout)
        if not isinstance(outcome, dict):
            raise AssertionError(f"rank {self._rank}: {outcome}")
        return outcome


class AttachedRanks:
    """The live engines of an existing lab, numbered by rank; see the module docstring."""

    backend = "gloo"
    backend_reason = "gloo (the lab's own group)"
    controller_pid = None

    def __init__(self, directory: str, start_timeout: float) -> None:
        self.directory = directory
        self.start_timeout = start_timeout       # connecting, and asking each engine its rank
        self.running = False
        self.client: Any = None
        self.engine_ids: list[int] = []    # index: torch rank

    # ------------------------------------------------------------- state
    @property
    def world_size(self) -> int:
        return len(self.engine_ids)

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def hosts(self) -> list[dict]:
        return [{"node_rank": 0, "address": SPAWN_HOST, "hostname": "localhost",
                 "ranks": list(range(self.world_size))}]

    def describe(self) -> str:
        ranks = f"{self.world_size} {plural(self.world_size, 'rank')}"
        return f"attached to the {ranks} of the lab in {self.directory}."

    # ------------------------------------------------------------- connecting
    def bring_up(self) -> Joins:
        """Connect and number the live engines by rank. Forms no group: no joins."""
        import ipyparallel as ipp
        url_file = os.path.join(self.directory, "security", "ipcontroller-lab-client.json")
        if not os.path.isfile(url_file):
            raise AssertionError("the grader found no running lab to check "
                                 "(start one with lab = ddplab.start(world_size=2))")
        self.client = ipp.Client(url_file, timeout=self.start_timeout)
        ranks = self._live_ranks()
        if sorted(ranks.values()) != list(range(len(ranks))):
            self.client.close()
            raise AssertionError("the lab's engines are not one lab's ranks "
                                 f"(their ranks: {sorted(ranks.values())})")
        by_rank = {rank: eid for eid, rank in ranks.items()}
        self.engine_ids = [by_rank[r] for r in range(len(ranks))]
        self.running = True
        return {}

    def formed(self) -> None:
        """No group was formed."""

    def _live_ranks(self) -> dict[int, int]:
        """Engine id -> rank of every live engine.

        Asked one engine at a time: for a few heartbeats after ``lab.restart()``
        the hub still lists the engines it killed, and a task sent to one of them
        fails with ``EngineError`` (one question to all of them would fail whole).
        """
        from ipyparallel.error import EngineError, RemoteError
        asked = {eid: self.client[eid].apply_async(_lab_rank) for eid in self.client.ids}
        ranks = {}
        for eid, answer in asked.items():
            try:
                ranks[eid] = answer.get(self.start_timeout)
            except (EngineError, RemoteError) as e:
                if isinstance(e, RemoteError) and e.ename != "EngineError":
                    raise
                log.debug("engine %s is gone (a restart's old engine)", eid)
        return ranks

    # ------------------------------------------------------------- running
    def apply(self, ranks: list[int], fn: Callable, *args: Any) -> list[Any]:
        return [_Checked(r, self.client[self.engine_ids[r]].apply_async(fn, *args)) for r in ranks]

    def lost(self, wait: float = 0.0) -> Loss | None:
        """Not watched from here: a rank whose engine is gone never answers (a hang)."""
        return None

    def confirm_loss(self, failures: dict[int, str]) -> Loss | None:
        return None

    def frames(self, ranks: list[int], deadline: float) -> dict[int, list]:
        return {}

    def out_of_reach(self, rank: int) -> str:
        """Nothing is read from another's ranks: a hang report says only that they still run."""
        return ""

    def collectives(self, ranks: list[int], deadline: float) -> dict[int, list[dict]]:
        return {}

    def cpu_seconds(self, ranks: list[int]) -> dict[int, float]:
        return {}

    def recorded(self, ranks: list[int], deadline: float) -> dict[int, dict]:
        """A stuck rank's recording cannot be read from here (``Trace.salvage``): the trace is cut."""
        return {}

    def interrupt(self, ranks: list[int]) -> None:
        """Never signals another's processes."""

    # ------------------------------------------------------------- ending
    def replace(self) -> Joins | None:
        """Never replaces another's engines."""
        return None

    def shut_down(self) -> None:
        """Close the client; the lab and its processes stay as they were."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self.running = False


def lab_at(directory: str, timeout: float) -> Any:
    """A ``Lab`` over the ranks of the lab whose private folder is ``directory``: its calls time
    out after ``timeout``; connecting to it, after ``LabSpec.start_timeout`` (a minute, or
    ``timeout`` if longer)."""
    from .lab import Lab
    spec = LabSpec.build(None, timeout=timeout)
    # No watchers: nobody watches this lab's screen, and the ranks' stacks, CPU time and
    # recorder are out of its reach (``ddplab.lab.watchers``).
    lab = Lab(spec, engines=AttachedRanks(directory, spec.start_timeout), watchers=())
    return lab.start()
