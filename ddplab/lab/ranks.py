"""The ``Ranks`` interface: the processes that run a lab's ranks, wherever they run.

A ``Lab`` (``ddplab.lab.lab``) is what a student calls; it is composed from a
``Ranks`` (the processes) and a ``Calls`` (``ddplab.lab.calls``: calls sent to
the ranks and how they ended). Three implementations, two chosen by ``start()``:

- ``LocalRanks`` (``ddplab.lab.local``): engines on this machine, forked from a
  warm template, signalled and read directly.
- ``HostRanks`` (``ddplab.lab.multihost.host_ranks``): engines on other hosts (SSH, Slurm,
  MPI, or a cluster you started and ``attach`` to), reached only through
  ipyparallel's controller.

and one for a process that drives a lab another started, without owning it:

- ``AttachedRanks`` (``ddplab.lab.attached``): the live engines of that lab,
  numbered by rank; it never forms or leaves a group, never starts or stops a
  process (the grading worker's view of a submission's lab).

What every implementation provides, and nothing else is asked of it:

=================================  ===========================================
``bring_up()``                     start (or connect to) the engines; the ``Joins``
``apply(ranks, fn, *args)``        ``fn(*args)`` on those ranks: one result each
``lost(wait)``                     the ranks whose engine is gone, and why (a ``Loss``)
``confirm_loss(failures)``         after a rank failed: was a rank (or host) lost?
``frames(ranks, deadline)``        each running rank's main stack (``{}``: unreadable)
``out_of_reach(rank)``             what a rank's place reads when its stack cannot be read
``collectives(ranks, deadline)``   each rank's latest collectives (flight recorder)
``cpu_seconds(ranks)``             CPU time each rank's process tree used (``{}``: unreadable)
``recorded(ranks, deadline)``      what a running trace recorded so far, even on a stuck rank
``interrupt(ranks)``               Kernel > Interrupt for those ranks
``formed()``                       the group of ``bring_up``'s joins formed
``replace()``                      fresh engines on the same controller, and their
                                   ``Joins``; None: cannot
``shut_down()``                    end everything it started
``running``, ``pids``,             state, for the lab and for tests and tools
``directory``, ``controller_pid``,
``hosts``, ``describe()``
=================================  ===========================================

A ``Ranks`` never sends a call through the lab's ``Calls``: forming the group
is the lab's (``Lab.start`` and ``restart`` submit the ``Joins`` a ``Ranks``
returns and wait for them as for any call, so a failed or hung join is
reported like a cell's).

Where a rank is, from its stack and its own answer, is read in one place for every caller
(``ddplab.lab.places``), from ``frames`` and ``collectives``.

``EngineSet`` holds what the local and multi-host implementations share: the ipyparallel client,
the engine of each rank, and the views that send one call to many engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..env import check_init_method, check_timeout, check_world_size
from . import fanout

#: The hub pings engines on this period and registers an engine only after a
#: ping, so the period bounds how fast a restart can be (ipyparallel's default
#: is 3 s). It declares an engine dead after ``HEARTBEAT_MISSES`` missed pings:
#: 3 s, long enough for a starved engine on a loaded laptop (or a far host) to
#: answer. One setting for local and multi-host labs.
HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 30
#: How long the hub takes at most to declare an engine lost.
HEARTBEAT_LOSS_S = HEARTBEAT_MS * HEARTBEAT_MISSES / 1000
#: By rank, the arguments of ``engine.join_group`` that form a lab's group;
#: ``{}``: no group to form (bare ranks, an attached lab).
Joins = dict[int, tuple]


def heartbeat_args() -> list[str]:
    """ipcontroller arguments for ``HEARTBEAT_MS`` and ``HEARTBEAT_MISSES``."""
    return [f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]


#: The least a lab's start waits, by default, whatever its call timeout (``LabSpec.start_timeout``).
START_TIMEOUT = 60.0


@dataclass(frozen=True, kw_only=True)
class LabSpec:
    """The arguments a lab was started with, by name; equal specs share one lab.

    Its timeouts, each for one thing (the process group's own, ``pg_timeout``, aside):

    - ``timeout``: a call's. Seconds a cell, ``lab.run`` or ``lab.wait`` may take before
      ``HangError`` (for ``lab.spawn`` and ``lab.run_script``, without progress); a call that
      sees a peer hang up waits for the controller to confirm the loss within it, at most
      ``ddplab.lab.multihost.host_ranks.LOSS_WAIT``.
    - ``start_timeout``: the start's (and each restart's). Seconds the engines may take to
      register with the controller, to answer their first questions, and to form the process
      group; for a lab attached to (``ddplab.attach``, the grader's view of a submission's lab),
      to connect to its controller. By default ``START_TIMEOUT``, or ``timeout`` if longer: a
      short call timeout (a deadlock shown in 5 s) never cuts a start short, and a lab given a
      longer one waits as long for its start, as it always did. Not compared: two specs that
      differ only here describe one lab.
    - ``grace``: how long a ``%%rank N`` cell waits before it returns and leaves the rank running.
    """
    world_size: int
    backend: str
    timeout: float
    grace: float
    pg_timeout: float
    debug: bool
    init_method: str | None = "store"   # see ddplab.start(); None: bare ranks
    start_timeout: float = field(default=START_TIMEOUT, compare=False)

    @classmethod
    def build(cls, world_size: Any, backend: str = "auto", timeout: Any = 60, *,
              grace: Any = 2.0, pg_timeout: Any = 1800, debug: Any = False,
              init_method: Any = "store", start_timeout: Any = None) -> "LabSpec":
        """A checked spec: ``ConfigError`` naming the fix for any bad argument.

        ``world_size=None`` (``attach``: every engine there) is kept as 0;
        ``start_timeout=None``: ``START_TIMEOUT``, or ``timeout`` if longer.
        """
        timeout = check_timeout(timeout)
        start_timeout = (max(START_TIMEOUT, timeout) if start_timeout is None
                         else check_timeout(start_timeout, "start_timeout"))
        return cls(world_size=0 if world_size is None else check_world_size(world_size),
                   backend=backend, timeout=timeout,
                   grace=check_timeout(grace, "grace", example=2),
                   pg_timeout=check_timeout(pg_timeout, "pg_timeout"), debug=bool(debug),
                   init_method=check_init_method(init_method), start_timeout=start_timeout)


@dataclass(frozen=True)
class Loss:
    """Ranks whose engine is gone: which, why (one sentence) and the call that recovers."""
    ranks: list[int]
    reason: str
    recovery: str = "lab.restart()"


class EngineSet:
    """The ipyparallel client and the engine of each rank; sends calls to them."""

    def __init__(self, client: Any, engine_ids: list[int]) -> None:
        self.client = client
        self.engine_ids = list(engine_ids)     # index: torch rank
        self._views: dict = {}
        # cloudpickle sends a notebook function with the globals it uses
        # (``dist``, ``torch``, a helper), as a student expects; plain
        # pickling would fail on the ranks with a NameError.
        client[self.engine_ids].use_cloudpickle()

    def view(self, ranks: tuple[int, ...]) -> Any:
        """ipyparallel's view of these ranks' engines, made once (making one costs more than a call)."""
        view = self._views.get(ranks)
        if view is None:
            ids = [self.engine_ids[r] for r in ranks]
            view = self._views[ranks] = self.client[ids[0] if len(ids) == 1 else ids]
        return view

    def apply(self, ranks: list[int], fn: Callable, *args: Any) -> list[Any]:
        """``fn(*args)`` on each of ``ranks``: one message per engine, the function pickled once."""
        if len(ranks) == 1:
            return [self.view((ranks[0],)).apply_async(fn, *args)]
        return fanout.apply_to_each(self.view(tuple(ranks)), fn, *args)

    def registered(self) -> set[int]:
        """The engine ids the controller still knows."""
        return set(self.client.ids)

    def close(self) -> None:
        self.client.close()


class Ranks(Protocol):
    """The processes of a lab's ranks; see this module's docstring."""

    running: bool
    backend: str
    backend_reason: str

    @property
    def world_size(self) -> int: ...
    @property
    def pids(self) -> list[int]: ...
    @property
    def directory(self) -> str: ...
    @property
    def controller_pid(self) -> int | None: ...
    @property
    def hosts(self) -> list[dict]: ...

    def bring_up(self) -> Joins: ...
    def formed(self) -> None: ...
    def apply(self, ranks: list[int], fn: Callable, *args: Any) -> list[Any]: ...
    def lost(self, wait: float = 0.0) -> Loss | None: ...
    def confirm_loss(self, failures: dict[int, str]) -> Loss | None: ...
    def frames(self, ranks: list[int], deadline: float) -> dict[int, list]: ...
    def out_of_reach(self, rank: int) -> str: ...
    def collectives(self, ranks: list[int], deadline: float) -> dict[int, list[dict]]: ...
    def cpu_seconds(self, ranks: list[int]) -> dict[int, float]: ...
    def recorded(self, ranks: list[int], deadline: float) -> dict[int, dict]: ...
    def interrupt(self, ranks: list[int]) -> None: ...
    def replace(self) -> Joins | None: ...
    def shut_down(self) -> None: ...
    def describe(self) -> str: ...
