"""``WitnessLab``: the grading worker's own handle on the ranks of a submission's lab.

The grader runs every check in its worker process (``ddplab.grade.witness``),
not in the submission's kernel, whose ``Lab`` the submission can patch. The
worker connects to the same lab's controller with the connection file in the
lab's private folder, and gives the checkers what they use of a lab, and
nothing more:

- ``run(fn, *args, ranks=, timeout=)``: by rank, ``RankError`` and
  ``HangError`` as ``Lab.run`` raises them;
- ``spawn(fn, args)``: ``fn(rank, *args)`` with the lab's group set aside
  (``own_group_demo``), as ``Lab.spawn``;
- ``trace()``: a ``ddplab.trace.Trace`` on these ranks (``bf16_hook``,
  ``accumulate`` count the bytes and the all_reduces of the student's code);
- ``world_size``, ``ranks``, ``check_ranks``.

Each live engine says which rank its lab made it (``debugger.settled_rank``),
so a lab of bare ranks that has not joined a group yet is numbered as the
kernel numbers it, and the engines a ``lab.restart()`` killed (the hub lists
them for a few heartbeats) are left out. What the ranks print during a check
is shown as ``Lab.run`` shows it. Replies are unpickled by
``ddplab.grade.unpickle.SafePickle`` (the worker installs it): plain data and
tensors only.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Callable, Iterable

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


class _NoSideChannel:
    """A stuck rank's recording cannot be read from here (``Trace.salvage``): the trace is cut."""

    def recorded(self, ranks: list[int], deadline: float) -> dict:
        return {}


class WitnessLab:
    """The grader's own handle on a lab's ranks (see the module docstring)."""

    engines = _NoSideChannel()

    def __init__(self, directory: str, timeout: float) -> None:
        import ipyparallel as ipp
        url_file = os.path.join(directory, "security", "ipcontroller-lab-client.json")
        if not os.path.isfile(url_file):
            raise AssertionError("the grader found no running lab to check "
                                 "(start one with lab = ddplab.start(world_size=2))")
        self.timeout = timeout
        self.client = ipp.Client(url_file, timeout=timeout)
        ranks = self._live_ranks(timeout)
        if sorted(ranks.values()) != list(range(len(ranks))):
            self.client.close()
            raise AssertionError("the lab's engines are not one lab's ranks "
                                 f"(their ranks: {sorted(ranks.values())})")
        by_rank = {rank: eid for eid, rank in ranks.items()}
        self.engines_by_rank = [by_rank[r] for r in range(len(ranks))]

    def _live_ranks(self, timeout: float) -> dict[int, int]:
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
                ranks[eid] = answer.get(timeout)
            except (EngineError, RemoteError) as e:
                if isinstance(e, RemoteError) and e.ename != "EngineError":
                    raise
                log.debug("engine %s is gone (a restart's old engine)", eid)
        return ranks

    @property
    def world_size(self) -> int:
        return len(self.engines_by_rank)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    @property
    def running(self) -> bool:
        return True

    def check_ranks(self, ranks: Iterable[int] | int | None) -> list[int]:
        """The ranks to run on, sorted; AssertionError if one is not a rank of this lab."""
        if ranks is None:
            return self.ranks
        chosen = sorted({ranks} if isinstance(ranks, int) else set(ranks))
        if not chosen or any(r not in self.ranks for r in chosen):
            raise AssertionError(f"ranks={chosen} are not ranks of this lab (0..{self.world_size - 1})")
        return chosen

    def run(self, fn: Callable, *args: Any, ranks: Iterable[int] | None = None,
            timeout: float | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the ranks: a list by rank, or a dict if ``ranks`` was given."""
        chosen = self.check_ranks(ranks)
        values = self._call({r: (fn, args, kwargs) for r in chosen}, timeout)
        return [values[r] for r in chosen] if ranks is None else values

    def spawn(self, fn: Callable, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """``fn(rank, *args)`` on every rank with the lab's group set aside (``Lab.spawn``)."""
        from ddplab.rank import owngroup
        limit = self.timeout if timeout is None else timeout
        port = self.run(owngroup.open_agent_store, SPAWN_HOST, self.world_size, limit,
                        ranks=[0], timeout=limit)[0]
        run_id = uuid.uuid4().hex[:12]
        env = {"MASTER_ADDR": SPAWN_HOST, "MASTER_PORT": str(port),
               "WORLD_SIZE": str(self.world_size)}
        try:
            values = self._call({r: (owngroup.run_spawned,
                                     (fn, r, args, dict(env, RANK=str(r)), run_id), {})
                                 for r in self.ranks}, limit)
        finally:
            try:
                self.run(owngroup.close_agent_store, ranks=[0])
            except Exception:
                # The ranks may be stuck after a failed spawn; the check's error is the one to keep.
                log.debug("could not close rank 0's spawn store", exc_info=True)
        return [values[r] for r in self.ranks]

    def trace(self, ranks: Iterable[int] | None = None, align: str = "auto") -> Any:
        """A ``ddplab.trace.Trace`` of these ranks: ``with lab.trace() as tr:``."""
        from ddplab.trace import Trace
        return Trace(self, ranks, align)

    def _call(self, calls: dict[int, tuple], timeout: float | None) -> dict[int, Any]:
        """``fn(*args, **kwargs)`` per rank, all at once; the values by rank, or the error."""
        from ddplab.errors import HangError
        from ddplab.lab.calls import rank_error
        from ddplab.rank import engine
        limit = self.timeout if timeout is None else timeout
        pending = {r: self.client[self.engines_by_rank[r]].apply_async(engine.call, fn, args, kwargs)
                   for r, (fn, args, kwargs) in calls.items()}
        deadline = time.monotonic() + limit
        while not all(p.ready() for p in pending.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not all(p.ready() for p in pending.values()):
            states = {r: "finished" if p.ready() else "still running" for r, p in pending.items()}
            raise HangError(f"ddplab: the ranks did not finish within timeout={limit:g} s "
                            f"(a deadlock?)", states)
        outcomes = {r: p.get() for r, p in pending.items()}
        refused = {r: o for r, o in outcomes.items() if not isinstance(o, dict)}
        if refused:
            rank = min(refused)
            raise AssertionError(f"rank {rank}: {refused[rank]}")
        from ddplab.lab import display
        for r in sorted(outcomes):                   # what the ranks printed, as Lab.run shows it
            display.replay(r, outcomes[r]["events"])
        failures = {r: o["error"] for r, o in outcomes.items() if not o["ok"]}
        if failures:
            raise rank_error(failures)
        return {r: o["value"] for r, o in outcomes.items()}

    def close(self) -> None:
        self.client.close()
