"""Stuck, or only long? What a call's timeout asks the ranks before it calls them hung.

A timeout that passes is not yet a hang. ``Calls.finish`` asks a ``Watch`` at
each expiry whether to wait on, and it answers from where the ranks are (their
stacks, read as the hang report reads them), the CPU time their processes
used, and torch's flight recorder. Two policies:

- **A cell's deadline** (``lab.run``, ``%%ranks``, checks): ``timeout`` bounds
  the ranks' *code*, so an endless loop in a cell still ends at it. Sending the
  result back is not the code's time: once every rank still running has
  returned from the code (its stack holds no call of it; at most ddplab's check
  that the value can be sent, or ipyparallel pickling and sending it), the wait
  goes on. A 256 MB tensor returned by each rank takes seconds to pickle and
  carry through the controller; it was reported as a deadlock.
- **A job's no-progress timeout** (``lab.spawn``, ``lab.run_script``;
  ``ddplab.launch`` has the same rule for its processes in ``procs.Group.wait``):
  a training run that is healthy past its timeout is not a hang. The wait goes
  on, logged at debug, while any rank progressed since the last look:

  - its process tree used ``procs.BUSY_SHARE`` of a core or more (computing,
    or moving a collective's data; a rank waiting in gloo uses about 0.5%);
  - its collectives moved in the flight recorder (one issued or finished: how
    a GPU's work shows, which uses no CPU);
  - it is somewhere else than at the last look (another line, another call);
  - it returned from the job, and its result is on its way.

  Only a whole timeout without any of these ends the job, and the hang report
  says which it was: every rank waiting in communication (a deadlock), or a
  rank sitting in its own code without using the CPU (sleeping, or waiting on
  a lock, a file, a queue). ``limit=`` caps a job's whole time, if asked for.

  One rank's wait is the hang, whatever the others do: a rank that has sat in
  one torch.distributed call for a whole timeout (as its live status measures
  it, ``blocked_s``), without using the CPU, ends the job, even while another
  rank computes for ever (``stopped == "waiting"``).

Both: a rank that *returned* while the ranks still running all sit in a
torch.distributed call is no progress but a verdict. Nothing is left to end
their wait, so once each has sat there ``RETURN_SETTLE`` seconds (or half the
timeout, if less) without using the CPU, the call ends at once, well within
its timeout (``abandoned``, ``stopped == "abandoned"``). So does a call whose
ranks all sit so in collectives the flight recorder says disagree (a mismatch,
or a rank behind in another call): none can finish (``"disagree"``). Ranks
that all wait in collectives that agree may yet meet (a GPU's barrier waits
for the work queued before it): their timeout decides.

On multi-host labs a rank's stack, CPU time and recorder are out of reach, so
a timeout there ends the call as it always did.
"""

from __future__ import annotations

import json
import logging
import os
import time

from .. import procs
from ..rank.where import locate
from ..text import plural
from . import diagnose, flight
from .ranks import Ranks

log = logging.getLogger(__name__)

#: The functions of ``ddplab/rank/engine.py`` that run a rank's code, and the one that checks,
#: once the code returned, that its value can be sent back.
_RUNS_CODE = ("call", "run_cell", "call_pickled")
_CHECKS_VALUE = "_sendable"
_ENGINE_FILE = os.path.join("ddplab", "rank", "engine.py")
#: How long one look may spend reading stacks and recorders.
LOOK_S = 3.0
#: Seconds the ranks still running must sit in a torch.distributed call, after another returned,
#: before the call ends as abandoned (half the timeout where that is less).
RETURN_SETTLE = 2.0
#: How often ``abandoned`` asks the ranks where they are (a question to a thread of each rank).
ABANDON_LOOK_S = 0.5


def code_returned(frames: list[tuple[str, int, str]]) -> bool:
    """Whether a rank whose call has not come back has left the call's code (innermost first).

    True when the rank is checking its value or no longer runs the call at all (ipyparallel
    pickles and sends the result); False while the code runs, and for an unread stack.
    """
    for filename, _, function in frames:
        if filename.endswith(_ENGINE_FILE):
            if function == _CHECKS_VALUE:
                return True
            if function in _RUNS_CODE:
                return False
    return bool(frames)


class Watch:
    """What a call's timeout does at each expiry; see this module's docstring.

    ``job``: a no-progress timeout (``lab.spawn``, ``lab.run_script``); else a cell's deadline.
    ``limit``: the job's whole time at most (None: no cap).
    """

    def __init__(self, engines: Ranks, *, job: bool = False, limit: float | None = None) -> None:
        self.engines = engines
        self.job = job
        self.limit = limit
        self.stopped = ""                # "stalled", "limit" or "": why the wait ended
        self.waiting: dict[int, bool] = {}   # at the last look: which ranks wait in communication
        self._begin = self._looked = time.monotonic()
        self._cpu: dict[int, float] = {}
        self._flight: dict[int, str] = {}
        self._where: dict[int, str] = {}
        self._frames: dict[int, list] = {}   # the stacks of the last look
        self.stuck: list[int] = []       # "waiting", "abandoned": the ranks that waited
        self.returned: list[int] = []    # "abandoned": the ranks that had returned
        self._busy: set[int] = set()     # the ranks that used the CPU in the last window
        self._next_ask = 0.0             # ``abandoned``: when to ask again
        self._calm: tuple[float, dict[int, float]] | None = None   # its first calm look

    def begin(self, ranks: list[int]) -> None:
        """Note where a job starts from: its CPU time and recorder (a cell's deadline needs none)."""
        self._begin = self._looked = time.monotonic()
        if self.job:
            self._cpu = self.engines.cpu_seconds(ranks)
            self._flight = self._recorders(ranks)

    def first(self, timeout: float) -> float:
        """How long the wait lasts before its first look: ``timeout``, or less if the cap is less."""
        return timeout if self.limit is None or not self.job else min(timeout, self.limit)

    def more(self, ranks: list[int], timeout: float) -> float:
        """At an expiry, with ``ranks`` still running: seconds to wait on (0: stop here)."""
        frames = self._frames = self.engines.frames(ranks, time.monotonic() + LOOK_S)
        found = {rank: locate(f) for rank, f in frames.items() if f}
        self.waiting = {rank: where.in_dist for rank, where in found.items()}
        returned = [rank for rank in ranks if code_returned(frames.get(rank, []))]
        if not self.job:
            if ranks and len(returned) == len(ranks):
                log.debug("ddplab: at the timeout, ranks %s have returned; their results are on "
                          "the way: waiting on", returned)
                return timeout
            return 0.0
        answers = self.engines.collectives(ranks, time.monotonic() + LOOK_S)
        why = self._progress(ranks, found, returned, answers)
        if not found and not self._cpu:
            self.stopped = "timeout"         # nothing readable (ranks on other hosts): a plain timeout
            return 0.0
        blocked = {rank: flight.site(answer).get("blocked_s") for rank, answer in answers.items()}
        blocked = {rank: held for rank, held in blocked.items()
                   if held is not None and rank not in self._busy}
        self.stuck = sorted(rank for rank, held in blocked.items() if held >= timeout)
        soonest = min((timeout - held for held in blocked.values()), default=timeout)
        if self.stuck and len(blocked) == len(ranks):      # every rank waits: a deadlock, once
            if soonest <= 0:                               # each has waited a whole timeout
                self.stopped = "stalled"
                return 0.0
        elif self.stuck:
            self.stopped = "waiting"
            return 0.0
        left = timeout
        if why and self.limit is not None:
            left = min(timeout, self._begin + self.limit - time.monotonic())
            if left <= 0:
                self.stopped = "limit"
                return 0.0
        if why or self.stuck:
            # A rank waiting in a call is looked at again when it will have waited a timeout.
            left = min(left, max(soonest, 0.1 * timeout))
            log.debug("ddplab: the job is not stuck at its timeout (%s): waiting another %.3g s",
                      why, left)
            return left
        self.stopped = "stalled"
        return 0.0

    def abandoned(self, running: list[int], returned: list[int], timeout: float) -> bool:
        """Whether ``running`` ranks wait for ``returned`` ones that will never come back, or for
        each other in collectives that disagree (the flight recorder's verdict): each has sat
        ``RETURN_SETTLE`` s (half ``timeout`` if less) in a torch.distributed call, and none
        used the CPU since the last ask. Asks every ``ABANDON_LOOK_S`` seconds."""
        now = time.monotonic()
        if not running or now < self._next_ask:
            return False
        self._next_ask = now + ABANDON_LOOK_S
        settle = min(RETURN_SETTLE, timeout / 2)
        # A short wait for the answers: the call's own wait (its live output) stalls meanwhile,
        # and a rank too busy to answer soon (a C call holding the GIL) is not waiting.
        answers = self.engines.collectives(running, now + ABANDON_LOOK_S)
        held = [flight.site(answers.get(rank, [])).get("blocked_s") for rank in running]
        if any(h is None or h < settle for h in held):
            self._calm = None
            return False
        cpu = self.engines.cpu_seconds(running)
        if self._calm is None or any(cpu.get(rank, 0.0) - self._calm[1].get(rank, 0.0)
                                     >= procs.BUSY_SHARE * (now - self._calm[0])
                                     for rank in running):
            self._calm = (now, cpu)          # calm from here on, if the next ask agrees
            return False
        if not returned and not any(line.startswith("ddplab:") for line in flight.report(answers)):
            return False                     # all wait, in calls that may yet meet: the timeout's
        self.stopped = "abandoned" if returned else "disagree"
        self.stuck, self.returned = sorted(running), sorted(returned)
        return True

    def seen(self, ranks: list[int]) -> tuple[dict, dict] | None:
        """Where ``ranks`` were at the last look, and their stacks, as ``Ranks.locate`` says it;
        None unless that look read every one of them (the hang report reads them itself)."""
        if not ranks or any(not self._frames.get(rank) for rank in ranks):
            return None
        return ({rank: diagnose.where(self._frames[rank]) for rank in ranks},
                {rank: diagnose.format_stack(self._frames[rank]) for rank in ranks})

    def _progress(self, ranks: list[int], found: dict, returned: list[int],
                  answers: dict[int, list[dict]]) -> str:
        """Why the job progressed since the last look ("" if it did not); notes this look
        (``answers``: what the ranks said of their collectives and where they are)."""
        reasons, window, self._looked = [], time.monotonic() - self._looked, time.monotonic()
        if returned:
            reasons.append(f"{plural(len(returned), 'rank')} {_names(returned)} returned")
        cpu = self.engines.cpu_seconds(ranks)
        busy = [rank for rank in ranks if cpu.get(rank, 0.0) - self._cpu.get(rank, cpu.get(rank, 0.0))
                >= procs.BUSY_SHARE * window]
        self._busy = set(busy)
        if busy:
            reasons.append(f"{plural(len(busy), 'rank')} {_names(busy)} used the CPU")
        recorded = _recorded(answers)
        moved = [rank for rank in ranks if rank in recorded and
                 recorded[rank] != self._flight.get(rank)]
        if moved:
            reasons.append(f"collectives moved on {plural(len(moved), 'rank')} {_names(moved)}")
        where = {rank: w.doing() for rank, w in found.items()}
        went = [rank for rank in where if rank in self._where and where[rank] != self._where[rank]]
        if went:
            reasons.append(f"{plural(len(went), 'rank')} {_names(went)} moved on in the code")
        self._cpu, self._flight, self._where = cpu, recorded, where
        return "; ".join(reasons)

    def _recorders(self, ranks: list[int]) -> dict[int, str]:
        return _recorded(self.engines.collectives(ranks, time.monotonic() + LOOK_S))

    def headline(self, timeout: float) -> str:
        """The first words of the hang report of a call this watch stopped ("" if it did not)."""
        stuck, many = self.stuck, len(self.stuck) > 1
        if self.stopped == "abandoned":
            gone = self.returned
            return (f"ddplab: {plural(len(gone), 'rank')} {_names(gone)} returned, and "
                    f"{plural(len(stuck), 'rank')} {_names(stuck)} {'wait' if many else 'waits'} "
                    f"in a torch.distributed call that needs {'them' if len(gone) > 1 else 'it'}: "
                    f"every rank still running sits in one without using the CPU, so nothing is "
                    f"left to end the wait. A hang, said now rather than at timeout={timeout:g} s.")
        if self.stopped == "disagree":
            return (f"ddplab: every rank still running waits in a torch.distributed call, and "
                    f"their collectives disagree (below): none of them can finish, so this is a "
                    f"hang, said now rather than at timeout={timeout:g} s.")
        if self.stopped == "waiting":
            return (f"ddplab: {plural(len(stuck), 'rank')} {_names(stuck)} "
                    f"{'have' if many else 'has'} waited in one torch.distributed call for "
                    f"timeout={timeout:g} s without it finishing (no CPU used): that wait is the "
                    f"hang, whatever the other ranks do meanwhile.")
        if self.stopped == "limit":
            return (f"ddplab: the job ran for limit={self.limit:g} s, its cap, and was stopped; it "
                    f"made progress in the last {timeout:g} s, so this is no sign of a hang.")
        if self.stopped != "stalled":
            return ""
        head = f"ddplab: no rank made progress for {timeout:g} s"
        waiting = sorted(rank for rank, inside in self.waiting.items() if inside)
        sitting = sorted(rank for rank, inside in self.waiting.items() if not inside)
        if self.waiting and not sitting:
            return (f"{head}: every rank waits in communication (no CPU time used, no collective "
                    f"finished), so they are waiting for each other (a deadlock).")
        if not sitting:
            return f"{head} (no CPU time used, no collective finished)."
        one = len(sitting) == 1
        also = (f", and {plural(len(waiting), 'rank')} {_names(waiting)} "
                f"{'waits' if len(waiting) == 1 else 'wait'} in communication (for "
                f"{'it' if one else 'them'})" if waiting else "")
        return (f"{head}: {plural(len(sitting), 'rank')} {_names(sitting)} {'is' if one else 'are'} "
                f"in {'its' if one else 'their'} own code, not a torch.distributed call, but "
                f"{'sits' if one else 'sit'} there without using the CPU (sleeping, or waiting on "
                f"a lock, a file, a queue){also}.")

def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _recorded(answers: dict[int, list[dict]]) -> dict[int, str]:
    """Each rank's collectives and the call it is in, as one comparable string (its site is
    left out: the time it has sat in a call grows at every look)."""
    return {rank: json.dumps([r for r in answer if "site" not in r], sort_keys=True)
            for rank, answer in answers.items()}
