"""What a call's wait does besides waiting: the ``Watcher``s its lab chose.

``Calls`` sends a call to the ranks and waits for it; everything else that happens while it
waits belongs to a watcher, and the ``Lab`` chooses which run (``Calls(engines, watchers)``):

- ``Front``: the notebook's front, for the person watching: progress bars
  (``ddplab.lab.bars``), the live areas (``live``) and a rank's pdb prompts (``debugger``);
- ``StallWatch`` (``ddplab.lab.stall``): what the timeout asks the ranks before it calls
  them hung, and the verdicts it reaches early.

A lab in a notebook (local ranks, ranks on hosts) runs both (``Lab``'s default). A lab attached
to another's ranks (``ddplab.lab.attached``: the grading worker's) runs none: nobody watches
its screen, and the ranks' stacks, CPU time and recorder are out of its reach, so its timeout
is plain, as it was.

The protocol, one method per moment of a wait; ``call`` (a ``Call``) is the wait's state:

=========================  ====================================================================
``start(call)``            the wait begins
``tick(call, now)``        each step of the wait (at least every 0.2 s, more often while
                           results come in): draw, serve a prompt. It may move
                           ``call.deadline`` (``call.excuse``: time at a prompt is the user's),
                           or return a ``Verdict``, which ends the wait as a hang at once
``expired(call, now)``     the deadline passed with ranks still running: a ``Verdict`` (a hang,
                           and what it found), or None having moved ``call.deadline`` (wait
                           on), or None (no opinion: the timeout stands)
``stop(call)``             the wait ended, however it ended (once; never raises)
=========================  ====================================================================

A watcher is made for one wait (the lab passes the kinds; ``Calls`` makes one of each per
wait), so it keeps what it needs between ticks on itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from . import bars, debugger, live
from .places import Place
from .ranks import Ranks

log = logging.getLogger(__name__)

#: What a call's timeout means: a cell's deadline (its code's time; ``lab.run``, ``%%ranks``),
#: a job's no-progress timeout (``lab.spawn``, ``lab.run_script``), or final (a ``%%rank``
#: cell's grace, forming the group): nothing is asked at it.
CELL, JOB, FINAL = "cell", "job", "final"


@dataclass
class Call:
    """One wait of ``Calls``, as its watchers see it."""
    engines: Ranks
    tasks: list[Any]                   # ``calls.Task``s, one per rank sent to
    timeout: float
    kind: str = CELL                   # CELL, JOB or FINAL: what the timeout means
    limit: float | None = None         # a job's whole time at most (None: no cap)
    own: list[Any] | None = None       # the tasks whose failure counts (None: all)
    deadline: float = 0.0              # time.monotonic() at which the timeout expires
    failed_at: float | None = None     # when one of ``own`` failed (the others then settle)
    notes: dict[int, str] = field(default_factory=dict)   # live-status words the kernel knows
    broken: str = ""                   # why the lab needs a restart, if a watcher found it
    verdict: "Verdict | None" = None   # what ended it as a hang, if a watcher said

    def running(self) -> list[int]:
        """The ranks whose task has not come back."""
        return sorted({t.rank for t in self.tasks if t.outcome is None})

    def returned(self) -> list[int]:
        """The ranks whose own task came back (finished or failed)."""
        owned = {id(t) for t in (self.tasks if self.own is None else self.own)}
        return sorted({t.rank for t in self.tasks if t.outcome is not None and id(t) in owned})

    def excuse(self, seconds: float) -> None:
        """``seconds`` were the user's, not the call's: move the deadline (and the settling
        after a failure) on by them."""
        if seconds:
            self.deadline += seconds
            if self.failed_at is not None:
                self.failed_at += seconds


@dataclass
class Verdict:
    """A watcher's conclusion that a call is hung, and what it saw."""
    stopped: str                       # why: "stalled", "waiting", "abandoned", "disagree",
                                       # "limit", "timeout" (``stall``'s words)
    headline: str = ""                 # the hang report's first line ("": the report's own)
    places: dict[int, Place] | None = None   # where the running ranks were (None: look again)

    @property
    def capped(self) -> bool:
        """Stopped at its cap while it moved: no verdict on who waits for whom."""
        return self.stopped == "limit"


class Watcher(Protocol):
    """Something a call's wait does besides waiting; see this module's docstring."""

    def start(self, call: Call) -> None: ...
    def tick(self, call: Call, now: float) -> Verdict | None: ...
    def expired(self, call: Call, now: float) -> Verdict | None: ...
    def stop(self, call: Call) -> None: ...


class Front:
    """The notebook's front during one wait: progress bars, live areas, a rank's pdb prompts.

    The three share what they show: the live status says ``in the debugger`` of the rank at a
    prompt (``call.notes``), and while ``input()`` waits for the user, a thread keeps the live
    areas updating. The seconds a rank waits at a prompt are the user's (``call.excuse``).
    """

    def __init__(self) -> None:
        self.bars = bars.ProgressBars()           # once a rank calls progress.report
        self.areas = live.Board()                 # once a rank prints, after OPEN_AFTER
        self.prompts: debugger.Prompter | None = None

    def start(self, call: Call) -> None:
        self.prompts = debugger.Prompter(call.engines.directory)

    def tick(self, call: Call, now: float) -> Verdict | None:
        self.bars.update({t.rank: t.result for t in call.tasks})
        call.notes = self.prompts.notes()
        self.areas.update(call.tasks, call.notes)
        thought = self.prompts.thinking
        self.prompts.serve(call.tasks, self.areas)
        # Time at a debugger prompt is the user's, not the cell's; a rank's time after the
        # line is sent (n into a barrier) counts again.
        call.excuse(self.prompts.thinking - thought)
        return None

    def expired(self, call: Call, now: float) -> Verdict | None:
        return None

    def stop(self, call: Call) -> None:
        self.areas.close()                        # the final output is printed after this
        if self.prompts is not None and self.prompts.broken:
            call.broken = self.prompts.broken


#: What a lab passes ``Calls``: the kinds of watcher to make for each wait.
Kinds = tuple[Callable[[], Watcher], ...]


def ticks(watchers: list[Watcher], call: Call) -> Verdict | None:
    """One step of every watcher; the first verdict, if one gave one."""
    now = time.monotonic()
    for watcher in watchers:
        verdict = watcher.tick(call, now)
        if verdict is not None:
            return verdict
    return None


def expiry(watchers: list[Watcher], call: Call) -> tuple[bool, Verdict | None]:
    """At the deadline: whether to wait on (a watcher moved the deadline), and any verdict."""
    before, now = call.deadline, time.monotonic()
    for watcher in watchers:
        verdict = watcher.expired(call, now)
        if verdict is not None:
            return False, verdict
    return call.deadline > before, None


def stop_all(watchers: list[Watcher], call: Call) -> None:
    """End every watcher that started; one that fails to end is logged, never raised."""
    for watcher in watchers:
        try:
            watcher.stop(call)
        except Exception:            # a watcher must never be why a call fails
            log.debug("a watcher did not stop cleanly", exc_info=True)
