"""The kernel's side of a rank's debugger: its prompts in the notebook, one rank at a time.

A rank stopped in pdb (``ddplab.breakpoint()``, ``%%rank N --pdb``,
``%ddplab_debug``; the rank's side is ``ddplab.rank.debugger``) publishes each
prompt as a request. ``Prompter.serve``, called from the wait loop of the
call (``Calls``), shows what pdb wrote and asks the notebook's user with
``input()``: in a Jupyter kernel that is an ``input_request`` (an input box in
JupyterLab, answerable by any Jupyter client), in a terminal the terminal's
stdin. The line typed goes back to the rank through a file in the lab's 0700
directory.

- **One rank at a time.** Once a rank's session begins, only its prompts are
  served until it ends (``c``, ``q``, or its call ends); then the lowest rank
  waiting at a prompt is next. Each prompt names its rank: ``(Pdb rank 1)``.
  One exception: a rank whose ``n`` took it into a collective (``blocked in
  barrier``) waits for the others, so a rank waiting at its prompt goes next.
- **The others are shown waiting.** While a rank is in the debugger the live
  status keeps updating (from a side thread while ``input()`` blocks):
  that rank reads ``in the debugger``, a rank waiting for it in a collective
  ``blocked in barrier, cell line 6``.
- **The timeout holds, less the user's thinking time.** Only the seconds
  a rank waits at a prompt (from its request to the answer: the user
  thinking at ``input()``) are the user's (``thinking``): ``Calls`` moves
  its deadline on by those. Once a line is sent, the rank's time counts
  again, so ``n`` over a ``dist.barrier()`` that another rank never reaches
  ends the cell with the hang report at ``--timeout``, as it would without the debugger. The live status then
  shows that rank ``blocked in barrier``, not ``in the debugger``.
- **Commands given up front** (``ddplab.breakpoint(commands=[...])``) answer
  the first prompts: each is shown after its prompt, as if typed, and sent
  back without asking, input box or not.
- **No input box** (nbval, a grader, ``allow_stdin`` off): every other prompt
  is answered ``c`` and the notebook says so once, so a notebook with a
  breakpoint in it still runs to its end unattended.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import threading
import time
from typing import Any, Iterator

from ..errors import DdplabError
from ..rank.debugger import REQUEST_KEY
from ..text import plural
from . import display, live
from .channel import published

#: What the live status says of a rank at the debugger's prompt.
AT_PROMPT = "in the debugger"
#: Seconds between two updates of the live status while the user types.
REFRESH = 0.2
log = logging.getLogger(__name__)


def request(task: Any) -> dict | None:
    """The latest debugger request (or end of session) a task's rank published, if any."""
    try:
        value = published(task.result).get(REQUEST_KEY)
    except Exception:              # polled every wait step: a bad message only loses a prompt
        log.debug("no debugger request in this result", exc_info=True)
        return None
    return value if isinstance(value, dict) else None


class Prompter:
    """Serves the debugger prompts of one wait's tasks; see this module's docstring."""

    def __init__(self, directory: str) -> None:
        self.directory = directory     # where answers may be written: the lab's 0700 folder
        self.current: Any = None       # the task whose rank's session is open
        self._seen: dict[int, int] = {}   # id(task) -> the last seq handled
        self._no_stdin = False
        self._fresh = False            # the open session has not shown its first prompt yet
        self.broken = ""               # why the lab needs a restart, after a prompt not answered
        self.thinking = 0.0            # seconds spent waiting for the user's lines, in all

    @property
    def open(self) -> bool:
        """Whether a rank's debugger session is open (its time is the user's, not the cell's)."""
        return self.current is not None

    def notes(self) -> dict[int, str]:
        """Live-status words for the rank in the debugger, by rank.

        None once its ``n`` took it into a collective: the rank's own status,
        ``blocked in barrier, cell line 6``, says more than "in the debugger".
        """
        task = self.current
        if task is None or (not self._new(task) and live.reported(task.result).startswith("blocked")):
            return {}
        return {task.rank: AT_PROMPT}

    def serve(self, tasks: list[Any], board: Any) -> bool:
        """Answer the open session's prompt, if one is waiting. True while a session is open."""
        self._end_if_over(tasks)
        if self.current is None:
            waiting = [t for t in sorted(tasks, key=lambda t: t.rank) if self._new(t)]
            if not waiting:
                return False
            self.current, self._fresh = waiting[0], True
        task = self.current
        asked = request(task)
        if asked is None or not self._new(task):
            return True                # between two prompts: the rank runs its n or s
        self._seen[id(task)] = asked["seq"]
        if asked.get("done"):
            _show(asked.get("text", ""))
            self.current = None
            return True
        self._answer(asked, self._ask(asked, tasks, board))
        return True

    def _new(self, task: Any) -> bool:
        asked = request(task)
        return (task.outcome is None and asked is not None
                and asked.get("seq", 0) > self._seen.get(id(task), 0))

    def _end_if_over(self, tasks: list[Any]) -> None:
        """End the open session if its call ended, or if its rank now waits for a rank at a prompt.

        ``n`` over ``dist.barrier()`` on rank 0 blocks rank 0 until rank 1, at
        its own prompt, gets there too: serving only rank 0 would wait forever.
        """
        task = self.current
        if task is None:
            return
        if task.outcome is not None:
            self.current = None        # its call ended: no prompt will come
            return
        status = live.reported(task.result)
        if self._new(task) or not status.startswith("blocked"):
            return
        others = [t for t in sorted(tasks, key=lambda t: t.rank) if t is not task and self._new(t)]
        if others:
            display.say(f"ddplab: rank {task.rank} is {status}, waiting for the other ranks; "
                        f"on to rank {others[0].rank}, at its prompt.")
            self.current = None

    def _ask(self, asked: dict, tasks: list[Any], board: Any) -> str | None:
        """Show the rank's pdb output, then ask for a line; None for end of input."""
        prompt = asked.get("prompt", f"(Pdb rank {asked.get('rank')}) ")
        given = asked.get("given")
        if isinstance(given, str):     # a command given up front: shown as if typed
            self._greet(asked)
            _show(asked.get("text", ""))
            display.say(prompt + given)
            return given
        if self._no_stdin or not _can_prompt():
            return self._go_on(asked)
        self._greet(asked)
        _show(asked.get("text", ""))
        board.update(tasks, self.notes())
        try:
            with _refreshing(board, tasks, self.notes()):
                return input(prompt)
        except EOFError:
            return None                # end of input: pdb quits, as in a terminal
        except Exception:              # StdinNotImplementedError (no input box), a closed or
            # captured stdin (OSError): the rank must not be left waiting for an answer.
            log.debug("no answer to the debugger's prompt", exc_info=True)
            return self._go_on(asked)

    def _greet(self, asked: dict) -> None:
        """The session's first line: which rank stopped, and the commands worth knowing."""
        if self._fresh:
            self._fresh = False
            display.say(f"ddplab: rank {asked.get('rank')} stopped in the debugger (n next line, "
                        f"s step in, p x print x, l list, c continue, q stop the cell).")

    def _go_on(self, asked: dict) -> str:
        """No one can answer: continue, and say so once per wait (the text is stable for nbval)."""
        if not self._no_stdin:
            self._no_stdin = True
            display.say(f"ddplab: rank {asked.get('rank')} stopped in the debugger, but this "
                        f"front end cannot answer a prompt (no stdin, as under nbval or a "
                        f"grader): it continues (c).")
        return "c"

    def _answer(self, asked: dict, line: str | None) -> None:
        # The rank waited at this prompt since it asked (the clock of this machine:
        # the debugger serves labs on this machine only): the user's time.
        since = asked.get("since")
        if isinstance(since, (int, float)):
            self.thinking += min(max(0.0, time.time() - since), 86400.0)
        path = str(asked.get("answer", ""))
        if not _reachable(os.path.dirname(path), self.directory):
            self.broken = "a rank waits at a debugger prompt this kernel cannot answer."
            raise DdplabError(
                f"ddplab: rank {asked.get('rank')} stopped in the debugger, but its folder is "
                f"on another host, out of this kernel's reach: the debugger works on a lab on "
                f"this machine. Recover with: lab.restart()")
        partial = path + ".partial"
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
                  encoding="utf-8") as f:
            json.dump({"seq": asked["seq"], "line": line}, f)
        os.replace(partial, path)      # the rank never reads half an answer


def _reachable(folder: str, lab_directory: str) -> bool:
    """Whether the kernel may write a rank's answer into ``folder``.

    The lab's own directory, or (ranks attached on this machine, hosts that
    share its disk) a folder here that only this user can open, as every
    rank's is.
    """
    folder = os.path.realpath(folder)
    if folder == os.path.realpath(lab_directory):
        return True
    try:
        info = os.stat(folder)
    except OSError:
        return False                   # on another host
    return info.st_uid == os.getuid() and not info.st_mode & 0o077


def _can_prompt() -> bool:
    """False in a Jupyter kernel whose front end sent this cell without ``allow_stdin``.

    Asked before pdb's text is shown, so a notebook run unattended (nbval, a
    grader) stores one stable line, not the stop's location. ipykernel keeps
    the flag on the kernel; where it has none, ``input()`` itself says so
    (``StdinNotImplementedError``, handled in ``_ask``).
    """
    try:
        from IPython import get_ipython
        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:
        return True
    return bool(getattr(kernel, "_allow_stdin", True))


def _show(text: str) -> None:
    if text:
        display.say(text)


@contextlib.contextmanager
def _refreshing(board: Any, tasks: list[Any], notes: dict[int, str]) -> Iterator[None]:
    """Keep the live status updating while the main thread waits in ``input()``.

    The thread runs in a copy of this context, so what it publishes belongs to
    the running cell (ipykernel keeps the cell's message header in a context
    variable).
    """
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(REFRESH):
            board.update(tasks, notes)

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(refresh,), name="ddplab-pdb-status",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def post_mortem(calls: Any, rank: int | None, timeout: float) -> None:
    """pdb in the frames of ``rank``'s last error (default: the last ``RankError``'s first rank).

    What ``lab.debug()`` and ``%ddplab_debug`` do. The session is served by the
    wait of that call, like any other prompt.
    """
    from ..errors import ConfigError
    from ..rank import debugger as on_rank, engine
    if rank is None:
        if not calls.failed:
            raise ConfigError("ddplab: no rank has raised yet, so there is nothing to debug "
                              "post-mortem. Run the failing cell, then %ddplab_debug (or "
                              "lab.debug()); to stop at a line instead, put "
                              "ddplab.breakpoint() in the cell.")
        rank = calls.failed[0]
        if len(calls.failed) > 1:
            display.say(f"ddplab: ranks {', '.join(map(str, calls.failed))} raised; debugging "
                        f"rank {rank} (lab.debug(rank=N) for another).")
    elif rank not in calls.failed and rank in calls.raised:
        failed = calls.failed
        last = (f"{plural(len(failed), 'rank')} {', '.join(map(str, failed))} did, "
                f"{calls.raised.get(failed[0], 'later')}" if failed else "no rank did")
        display.say(f"ddplab: rank {rank} did not raise in the last call that failed ({last}). "
                    f"The error below is rank {rank}'s own last one, from an earlier call: "
                    f"{calls.raised[rank]}.")
    stuck = calls.ensure_idle(rank)
    task = calls.call(rank, engine.call, on_rank.post_mortem, (), {})
    calls.finish([task], timeout, grace=None)
    if stuck:
        display.say("ddplab: the other ranks are still stuck waiting for the rank that failed. "
                    "Recover with: lab.restart()")
