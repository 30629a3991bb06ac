"""Where each running rank is: one look, for every part of the lab that asks.

The hang report, the stall watch, a ``%%rank`` cell left running, a failure that left ranks
stuck, ranks waiting to join: each asks where the ranks are, and each asks ``look``. It
reads the two sources that can answer while a rank is stuck, in one order:

1. **its stack**, the place: the main thread's frames, which faulthandler dumps on
   SIGUSR1 even while the rank waits inside C++ (``Ranks.frames``, ``diagnose``), read as
   ``ddplab.rank.where`` reads a stack: ``in all_reduce (cell line 3)``, ``at cell line 2``;
2. **its own answer**, detail (``Ranks.collectives``, ``ddplab.rank.flight``): a thread of
   the rank says which collectives it issued (torch's flight recorder), the send, recv or
   broadcast it is in with their arguments, and its *site*: where in its own code, whether
   it is late there, how long it has sat in one torch.distributed call (``blocked_s``), and
   what its stack hides (a handle's ``Work.wait()``, an ``await``), which refines the line.

The live status a rank publishes while a cell runs (``blocked in recv, cell line 3``,
``ddplab.rank.blocked``) is the same site, for the live areas (``live``) only; the CPU time
the ranks use is progress, not place, and ``stall`` reads it itself. Each caller says how
long each source may take (0: not read). On another host neither source is in reach, and
the place says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..rank.where import NO_STACK, locate
from . import diagnose, flight
from .ranks import Ranks

#: The functions of ``ddplab/rank/engine.py`` that run a rank's code, and the one that checks,
#: once the code returned, that its value can be sent back.
_RUNS_CODE = ("call", "run_cell", "call_pickled")
_CHECKS_VALUE = "_sendable"
_ENGINE_FILE = os.path.join("ddplab", "rank", "engine.py")


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


@dataclass(frozen=True)
class Place:
    """Where one rank is, as one look found it."""
    line: str                          # "in all_reduce (cell line 3)": the hang report's words
    doing: str = ""                    # "in send (cell line 1)", or "at cell line 3" in its code
    in_dist: bool = False              # inside a torch.distributed call: waiting for another rank
    busy: bool = False                 # running its own code (its site says so, else its stack)
    returned: bool = False             # left the call's code: its result is on its way
    stack: str = ""                    # its frames from the user's line inward, as a traceback
    frames: tuple = ()                 # its main thread's frames, innermost first (): unread
    answer: tuple = ()                 # its own answer: collectives, its call, its site

    @property
    def read(self) -> bool:
        """Whether its stack was read (a rank on another host's never is)."""
        return bool(self.frames)

    @property
    def blocked_s(self) -> float | None:
        """Seconds it has sat in one torch.distributed call, as it says (None: in none, or unsaid)."""
        return flight.site(list(self.answer)).get("blocked_s")


@dataclass
class Look:
    """One look at some ranks: their places, and the answers of every rank asked."""
    places: dict[int, Place] = field(default_factory=dict)
    answers: dict[int, list[dict]] = field(default_factory=dict)

    def where(self) -> dict[int, str]:
        """Each placed rank's line: ``{0: "in recv (cell line 3)"}`` (none where nothing is said)."""
        return {rank: place.line for rank, place in self.places.items() if place.line}

    def stacks(self) -> dict[int, str]:
        """Each rank's stack, as a traceback ("": unread)."""
        return {rank: place.stack for rank, place in self.places.items() if place.read}


def place(frames: list, answer: list[dict], unread: str = NO_STACK) -> Place:
    """A rank's place from its frames and its answer (``unread``: its words when no stack came,
    ``Ranks.out_of_reach``)."""
    found = locate(frames)
    line = diagnose.where(frames) if frames else unread
    said = flight.site(answer)
    stack = diagnose.format_stack(frames)
    return Place(line=flight.refine(line, answer), in_dist=found.in_dist or flight.refine(
                     "", answer).startswith("in Work.wait"),
                 doing=flight.refine("", answer) or found.doing(),
                 busy=said.get("own", diagnose.busy_in_own_code(stack)),
                 returned=code_returned(frames), stack=stack, frames=tuple(frames),
                 answer=tuple(answer))


def look(engines: Ranks, ranks: list[int], *, stacks: float = 0.0, answers: float = 0.0,
         ask: list[int] | None = None) -> Look:
    """Where ``ranks`` are: their stacks read for up to ``stacks`` seconds, the answers of
    ``ask`` (default: ``ranks``) for up to ``answers`` seconds (0: that source is not read)."""
    ranks = sorted(ranks)
    frames = engines.frames(ranks, time.monotonic() + stacks) if stacks and ranks else {}
    asked = sorted(ranks if ask is None else ask)
    said = engines.collectives(asked, time.monotonic() + answers) if answers and asked else {}
    out = Look(answers=said)
    for rank in ranks:
        out.places[rank] = place(frames.get(rank, []), said.get(rank, []),
                                 "" if frames.get(rank) else engines.out_of_reach(rank))
    return out
