"""Calls on the ranks, and how they ended: what ``lab.run`` and ``%%ranks`` wait on.

``Calls`` sends a function or a cell to some ranks (through the lab's
``Ranks``), waits for them while live output and progress bars update, shows
each rank's output in rank order, and turns what happened into one outcome:

- every rank finished: the values, by rank;
- a rank raised: ``RankError`` with its traceback (at once if the others are
  stuck waiting for it: they are reported where they wait);
- the ranks did not finish within the timeout: ``HangError`` saying where each
  stuck rank is (``ddplab.lab.diagnose``). What counts as the timeout is a
  ``stall.Watch``'s: a cell's code gets ``timeout`` (sending its result back is
  not counted); a job (``lab.spawn``, ``lab.run_script``) ends only after a
  whole timeout without progress;
- a ``%%rank N`` cell still running after its grace: it stays *pending*, says
  whether it waits for another rank, and its output and errors come with the
  next call that finishes (labelled as that earlier cell's);
- an engine is gone: ``EngineDiedError`` naming the rank and the likely cause;
- Kernel > Interrupt: SIGINT to the running ranks, and whether the lab is usable.

After a hang, a rank stuck after a failure, a lost engine or an interrupt that
a rank could not obey, the lab is *broken*: ``broken`` says why and every call
says to ``lab.restart()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import DdplabError, EngineDiedError, HangError, RankError
from ..text import plural, shorten
from . import bars, debugger, diagnose, display, flight, live
from .ranks import Loss, Ranks
from .stall import Watch

#: After one rank fails, how long the others get to finish before we conclude
#: they are waiting for it (in a collective, or a recv) and report the failure.
FAILURE_SETTLE = 1.0
#: The most of one rank's error a ``RankError``'s message shows (the notebook gets all of it
#: otherwise: a 10 MB message, 10 MB of output); ``RankError.failures`` keeps the whole.
ERROR_CHARS = 20_000
#: ``broken`` after a rank failed while others waited for it. The failed rank
#: itself is idle, so a post-mortem on it (``lab.debug()``) still works.
STUCK_AFTER_FAILURE = "ranks are stuck waiting for a rank that failed."


@dataclass
class Task:
    """One submission to one rank, and what came back."""
    rank: int
    result: Any                    # an ipyparallel AsyncResult, or one rank's part of one
    note: str = ""                 # label suffix when shown late
    outcome: dict | None = field(default=None)


class Calls:
    """The calls a lab sent to its ranks; see this module's docstring."""

    def __init__(self, engines: Ranks, *, bare: bool = False) -> None:
        self.engines = engines         # the processes of the ranks (``lab.engines``)
        self.bare = bare               # ranks that join a group themselves (init_method=None)
        self.pending: list[Task] = []  # %%rank cells left running after their grace
        self.broken = ""               # why the lab needs a restart, if it does
        self.failed: list[int] = []    # the ranks of the last RankError (``lab.debug`` looks there)
        self.raised: dict[int, str] = {}   # each rank's last error: which cell, when (``lab.debug``)

    # ------------------------------------------------------------- sending
    def submit(self, ranks: list[int], fn: Callable, *args: Any) -> list[Task]:
        """``fn(*args)`` on each of ``ranks``, not waited for: one ``Task`` per rank."""
        return [Task(rank, result) for rank, result in zip(ranks, self.engines.apply(ranks, fn, *args))]

    def call(self, rank: int, fn: Callable, *args: Any) -> Task:
        """``fn(*args)`` on one rank, not waited for."""
        return self.submit([rank], fn, *args)[0]

    # ------------------------------------------------------------- health
    def died(self, loss: Loss) -> EngineDiedError:
        """Record a lost engine: the lab is broken until restarted. The error to raise."""
        self.broken = loss.reason
        return EngineDiedError(f"ddplab: {loss.reason} Recover with: {loss.recovery}",
                               loss.ranks, reason=loss.reason)

    def check_alive(self, wait: float = 0.0) -> None:
        """Raise ``EngineDiedError`` naming the ranks whose engine is gone."""
        loss = self.engines.lost(wait)
        if loss is not None:
            raise self.died(loss)

    def ensure_usable(self) -> None:
        """Raise ``DdplabError`` saying how to recover if the lab is stopped or broken."""
        if not self.engines.running:
            raise DdplabError("ddplab: this lab is stopped. Start one with "
                              "lab = ddplab.start(...) or call lab.restart().")
        if self.broken:
            raise DdplabError(f"ddplab: {self.broken} Recover with: lab.restart()")
        self.check_alive()

    def ensure_idle(self, rank: int) -> bool:
        """Raise unless ``rank`` can take a call; True if only ranks waiting for it are stuck.

        After a rank failed while others waited for it, the lab is broken but
        the failed rank is idle: a post-mortem on it (``lab.debug()``) still works.
        """
        if self.broken == STUCK_AFTER_FAILURE and rank in self.failed and self.engines.running:
            self.check_alive()
            return True
        self.ensure_usable()
        return False

    def broken_reason(self) -> str:
        """Why the lab needs ``restart()`` (a hang, a rank stuck after a failure, a lost
        engine), or ``""`` while it is usable or stopped."""
        if self.engines.running and not self.broken:
            try:
                self.check_alive()
            except EngineDiedError:
                pass                      # check_alive recorded why
        return self.broken if self.engines.running else ""

    def forget(self) -> None:
        """The ranks were replaced: nothing is pending, nothing is broken, no error to debug."""
        self.pending.clear()
        self.broken = ""
        self.failed = []
        self.raised = {}

    # ------------------------------------------------------------- waiting
    def await_join(self, tasks: list[Task], timeout: float) -> None:
        """Wait for the ranks' ``join_group`` calls; raise if one failed or they hang."""
        if self._wait(tasks, timeout) != "done":
            failures = self._replay(tasks)
            if failures:
                raise rank_error(failures)
            raise self._hang_error(tasks, timeout, "init_process_group")

    def finish(self, tasks: list[Task], timeout: float, grace: float | None,
               watch: Watch | None = None) -> None:
        """Wait for ``tasks`` and earlier pending tasks, show output, raise on failure.

        A failure of an earlier cell (one left running after its grace) is shown,
        labelled as that cell's, and never fails this call or changes its result.
        ``watch``: what the timeout means (``stall``); by default a cell's deadline.
        """
        pending, self.pending = self.pending, []
        everything = pending + tasks
        watch = None if grace is not None else watch or Watch(self.engines)
        state = self._wait(everything, timeout if grace is None else grace, own=tasks, watch=watch)
        if state == "timeout" and grace is None:
            self._replay(everything, stuck=True)
            raise self._hang_error(everything, timeout, "cell", watch)
        still = [t for t in everything if t.outcome is None]
        failures = _failures(tasks)
        if failures:
            self.failed = sorted(failures)
        self.raised.update({rank: _when() for rank in {**failures, **_failures(pending)}})
        # Ranks still running beside a failure are about to be reported stuck.
        self._replay(everything, stuck=bool(failures and still))
        late = _failures(pending)
        if failures and still:
            # A rank failed while others wait for it in a collective: they
            # would wait until the group's timeout, so report it now.
            raise self._stuck_after_failure(failures, still)
        for task in still:
            task.note = "(the earlier cell that was still running)"
        self.pending = still
        if late:
            display.say("\n".join(
                f"ddplab: the earlier cell still running on rank {rank} raised (this is that "
                f"cell's error, not this cell's):\n{error}" for rank, error in sorted(late.items())))
        joining = self._joining(still)
        if joining:
            display.say(diagnose.joining_message(joining, self.engines.world_size))
        elif still:
            self._say_still_running(still)
        if failures:
            returned = sorted(t.rank for t in tasks if t.outcome is not None and t.outcome["ok"])
            raise rank_error(failures, returned)

    def wait_pending(self, timeout: float) -> None:
        """Wait for cells still running from earlier ``%%rank`` cells; their failures raise."""
        earlier, self.pending = self.pending, []
        self.finish(earlier, timeout, grace=None)

    def _wait(self, tasks: list[Task], timeout: float, own: list[Task] | None = None,
              watch: Watch | None = None) -> str:
        """Wait for ``tasks``; return ``"done"``, ``"failed"`` or ``"timeout"``.

        ``"failed"``: a rank failed and the others have not finished for
        ``FAILURE_SETTLE`` seconds, so they are most likely waiting for it.
        Only failures of ``own`` (default: all of ``tasks``) count: an earlier
        cell's late failure blocks nobody in this call. ``watch``: asked at
        each expiry whether to wait on (``stall``); None: the timeout is final.
        """
        own_ids = {id(t) for t in (tasks if own is None else own)}
        if watch is not None:
            watch.begin(sorted({t.rank for t in tasks}))
        deadline = time.monotonic() + (timeout if watch is None else watch.first(timeout))
        failed_at = None
        board = bars.ProgressBars()              # live bars, once a rank calls progress.report
        areas = live.Board()                     # live output, once a rank prints
        prompts = debugger.Prompter(self.engines.directory)   # a rank's pdb prompts, if any
        try:
            while True:
                for task in tasks:
                    if task.outcome is None and task.result.ready():
                        task.outcome = self._outcome(task)
                board.update({t.rank: t.result for t in tasks})
                areas.update(tasks, prompts.notes())
                thought = prompts.thinking
                prompts.serve(tasks, areas)
                # Time at a debugger prompt is the user's, not the cell's; a rank's
                # time after the line is sent (n into a barrier) counts again.
                thought = prompts.thinking - thought
                deadline += thought
                failed_at = None if failed_at is None else failed_at + thought
                undone = [t for t in tasks if t.outcome is None]
                if not undone:
                    return "done"
                now = time.monotonic()
                if failed_at is None and any(not t.outcome["ok"] for t in tasks
                                             if t.outcome and id(t) in own_ids):
                    failed_at = now
                if failed_at is not None and now - failed_at >= FAILURE_SETTLE:
                    return "failed"
                if watch is not None and failed_at is None and watch.abandoned(
                        sorted({t.rank for t in undone}),
                        sorted({t.rank for t in tasks if t.outcome and id(t) in own_ids}), timeout):
                    return "timeout"             # ranks wait for nothing that can come: say it now
                if now >= deadline:
                    more = 0.0 if watch is None else \
                        watch.more(sorted({t.rank for t in undone}), timeout)
                    if not more:
                        return "timeout"
                    deadline = time.monotonic() + more
                    continue
                if not undone[0].result.wait(min(0.2, deadline - now)):
                    self.check_alive()           # no news for a while: is someone dead?
        except KeyboardInterrupt as interrupt:
            self._interrupt(tasks)
            # IPython shows this one line instead of the stack of ddplab's, ipyparallel's and
            # threading's frames the interrupt met; what became of the ranks is said above.
            interrupt._render_traceback_ = lambda: [
                "KeyboardInterrupt: the call was interrupted (what became of the ranks is said "
                "above)"]
            raise
        finally:
            areas.close()                        # the final output is printed after this
            self.broken = prompts.broken or self.broken

    def _outcome(self, task: Task) -> dict:
        """A finished task's outcome; a lost engine (which the ranks name) is recorded."""
        try:
            return task.result.get()
        except EngineDiedError as e:
            self.broken = e.reason or self.broken
            raise

    def _interrupt(self, tasks: list[Task]) -> None:
        """Kernel > Interrupt: pass SIGINT on to the ranks still running."""
        running = [t for t in tasks if not t.result.ready()]
        self.engines.interrupt([t.rank for t in running])
        deadline = time.monotonic() + 3
        for task in running:
            while not task.result.ready() and time.monotonic() < deadline:
                task.result.wait(0.1)
        stuck = [t.rank for t in running if not t.result.ready()]
        self.pending = []
        if stuck:
            self.broken = (f"rank {', '.join(map(str, stuck))} did not stop on interrupt "
                           f"(blocked inside a torch.distributed call).")
            display.say(f"ddplab: interrupted; {self.broken} Recover with: lab.restart()")
        else:
            display.say("ddplab: interrupted; the ranks stopped and the lab is usable.")

    # ------------------------------------------------------------- reporting
    @staticmethod
    def _replay(tasks: list[Task], stuck: bool = False) -> dict[int, str]:
        """Show finished tasks' output in rank order; return their failures by rank.

        ``stuck``: the unfinished tasks are stuck (a hang is about to be
        reported), so show what they printed before, from their live screens.
        """
        failures: dict[int, str] = {}
        for task in sorted(tasks, key=lambda t: t.rank):
            if task.outcome is not None:
                display.replay(task.rank, task.outcome["events"], task.note)
                if not task.outcome["ok"]:
                    failures[task.rank] = task.outcome["error"]
            elif stuck:
                _replay_stuck(task)
        return failures

    def _locate(self, tasks: list[Task], seconds: float) -> tuple[dict, dict]:
        return self.engines.locate(sorted({t.rank for t in tasks}), time.monotonic() + seconds)

    def _joining(self, still: list[Task]) -> list[int]:
        """On bare ranks: the still-running ranks, if every one waits in init_process_group."""
        if not self.bare or not still:
            return []
        where = self._locate(still, 2)[0]
        if all(diagnose.waiting_to_join(w) for w in where.values()):
            return sorted(where)
        return []

    def _say_still_running(self, still: list[Task]) -> None:
        """Say which ranks a cell left running, and whether each waits for another rank."""
        ranks = sorted({t.rank for t in still})
        frames = self.engines.frames(ranks, time.monotonic() + 4)
        said = self.engines.collectives(ranks, time.monotonic() + 2)   # what a stack hides
        doing = {rank: diagnose.activity(frames.get(rank, [])) for rank in ranks}
        doing = {rank: (in_dist or flight.refine("", said.get(rank, [])).startswith(
                            "in Work.wait"),
                        flight.refine("", said.get(rank, [])) or what)
                 for rank, (in_dist, what) in doing.items()}
        waiting = [rank for rank in ranks if doing[rank][0]]
        tail = ("It keeps running; its output appears when a later ddplab cell finishes, "
                "or call lab.wait().")
        if len(ranks) == 1:
            rank, (in_dist, what) = ranks[0], doing[ranks[0]]
            why = (f"{what}: waiting for another rank (a send waits for its recv, a collective "
                   f"for every rank). Run the matching cell on the other rank." if in_dist else
                   f"{what}, not inside a torch.distributed call: it is busy with its own "
                   f"work, not waiting for another rank.")
            display.say(f"ddplab: rank {rank} is still running this cell, {why} {tail}")
            return
        lines = [f"ddplab: ranks {', '.join(map(str, ranks))} are still running this cell:"]
        lines += [f"  rank {rank}: {what}, " + ("waiting for another rank" if in_dist else
                                                "not inside a torch.distributed call (busy, "
                                                "not waiting)")
                  for rank, (in_dist, what) in doing.items()]
        if waiting:
            lines.append("A rank inside a torch.distributed call waits for the matching call "
                         "on the other ranks: run that cell.")
        lines.append(tail.replace("It keeps", "They keep").replace("its output", "their output"))
        display.say("\n".join(lines))

    def _stuck_after_failure(self, failures: dict[int, str], still: list[Task]) -> RankError:
        loss = self.engines.confirm_loss(failures)
        if loss is not None:
            raise self.died(loss)
        where = self._locate(still, 4)[0]
        self.broken = STUCK_AFTER_FAILURE
        error = rank_error(failures)
        lines = [str(error), "Meanwhile:"]
        lines += [f"  rank {rank}: still {where[rank]}, waiting for the failed rank"
                  for rank in sorted(where)]
        lines.append("Those ranks cannot be freed from inside. Recover with: lab.restart()")
        return RankError("\n".join(lines), failures)

    def _hang_error(self, tasks: list[Task], timeout: float, what: str,
                    watch: Watch | None = None) -> HangError:
        states = {t.rank: ("still running" if t.outcome is None else
                           "finished" if t.outcome["ok"] else "failed") for t in tasks}
        still = sorted({t.rank for t in tasks if t.outcome is None})
        seen = watch.seen(still) if watch is not None else None   # the stacks it just read
        where, stacks = seen or self._locate([t for t in tasks if t.outcome is None], 4)
        collectives = self.engines.collectives(list(range(self.engines.world_size)),
                                               time.monotonic() + 2)
        where = {rank: flight.refine(line, collectives.get(rank, [])) for rank, line in where.items()}
        # In its own code: as the rank says it (its site), else as its stack suggests.
        busy = sorted(r for r in where if flight.site(collectives.get(r, [])).get(
            "own", diagnose.busy_in_own_code(stacks.get(r, ""))))
        head = watch.headline(timeout) if watch is not None else ""
        lines = [head or f"ddplab: the {what} did not finish within timeout={timeout:g} s; "
                 + diagnose.headline(busy, sorted(set(where) - set(busy)), timeout)]
        # A rank still running an earlier cell (a %%rank cell left running) is at that cell's
        # line; this cell waits behind it on that rank's queue.
        earlier = {t.rank for t in tasks if t.outcome is None and t.note} & \
            {t.rank for t in tasks if not t.note}
        for rank, state in states.items():
            at = where.get(rank, "")
            if rank in earlier and at:
                at += " of the earlier cell, which still runs there (this cell waits behind it)"
            lines.append(f"  rank {rank}: " + (f"still {at}" if at else state))
        if any(diagnose.waiting_to_join(w) for w in where.values()):
            lines.append(diagnose.join_hint(self.engines.world_size))
        capped = watch is not None and watch.stopped == "limit"
        # A job stopped at its cap was moving: no verdict on who waits for whom.
        lines += [line for line in flight.report(collectives, busy, timeout)
                  if not (capped and line.startswith("ddplab:"))]
        # The calls' own arguments (a tag, a src) are evidence; the pattern of where ranks wait
        # is a guess: with a third rank finished, a tag mismatch read as waiting for that rank.
        hint = "" if capped else (flight.call_hint(collectives)
                                  or diagnose.deadlock_hint(states, where, stacks))
        if hint:
            lines.append(hint)
        for rank, stack in stacks.items():
            if stack:
                lines.append(f"Stack of rank {rank} (most recent call last):\n{stack}")
        self.broken = "ranks are stuck after a hang."
        lines.append("Stuck ranks cannot be freed from inside. Recover with: lab.restart()")
        return HangError("\n".join(lines), states, where, stacks, collectives)


def _failures(tasks: list[Task]) -> dict[int, str]:
    return {t.rank: t.outcome["error"] for t in tasks
            if t.outcome is not None and not t.outcome["ok"]}


def _when() -> str:
    """Which cell of the notebook runs now, and the time: ``cell In [7], at 14:02:11``."""
    try:
        from IPython import get_ipython
        count = getattr(get_ipython(), "execution_count", None)
    except ImportError:
        count = None
    return (f"cell In [{count}], " if count else "") + time.strftime("at %H:%M:%S")


def _replay_stuck(task: Task) -> None:
    """Show what a stuck rank printed before it got stuck: its last live screen."""
    text = live.screen(task.result)
    if text:
        last = text if text.endswith("\n") else text + "\n"
        display.replay(task.rank, [("stdout", last)],
                       "(stuck; what it printed last, before the diagnosis below)")


def rank_error(failures: dict[int, str], returned: list[int] = ()) -> RankError:
    """The ``RankError`` for tracebacks by rank: one head line, then each rank's traceback.

    ``returned``: the ranks of the call that finished. When every failure is gloo's
    "Connection closed by peer" in a torch.distributed call, the head says that those ranks
    left without making the call the others waited in (``diagnose.peer_left``): no rank crashed.
    """
    ranks = sorted(failures)
    waited = {rank: diagnose.waited_when_peer_left(text) for rank, text in failures.items()}
    head = diagnose.peer_left(waited, list(returned)) if all(waited.values()) else ""
    head = head or f"ddplab: the code raised on {plural(len(ranks), 'rank')} {', '.join(map(str, ranks))}."
    body = "\n".join(f"--- rank {rank} ---\n"
                     + shorten(failures[rank], ERROR_CHARS, f"the error's .failures[{rank}]")
                     for rank in ranks)
    return RankError(f"{head}\n{body}", failures)
