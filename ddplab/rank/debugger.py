"""pdb on a rank, with its prompt in the notebook: ``ddplab.breakpoint()``, ``--pdb``, post-mortem.

An engine has no terminal: a plain ``pdb.set_trace()`` there reads an empty
stdin and quits at once. A rank's debugger is a ``pdb.Pdb`` whose stdin and
stdout are a ``Channel`` to the notebook kernel:

- what pdb writes (where it stopped, ``p``'s answer, its prompt
  ``(Pdb rank 1) ``) collects in the channel; when pdb reads a line, the
  channel *publishes* a request on the rank's data channel (the one the live
  screen uses, ``live.publisher()``)::

      {REQUEST_KEY: {"seq": 3, "rank": 1, "text": "...", "prompt": "(Pdb rank 1) ",
                     "answer": "/tmp/ddplab-xyz/pdb-rank1.answer"}}

- the kernel, in the wait loop of the call (``ddplab.lab.debugger``), prints
  the text and asks the notebook's user with ``input()``: a Jupyter
  ``input_request``, an input box in JupyterLab. It writes the line typed to
  the ``answer`` file, in the lab's owner-only (0700) directory, and the rank,
  which polls that file every ``POLL`` seconds, hands it to pdb;
- commands given up front (``ddplab.breakpoint(commands=["p x", "c"])``, as
  ``python -m pdb -c``) ride in the request as ``"given": "p x"``: the kernel
  shows them after the prompt, as if typed, and sends them back without
  asking, so a notebook run unattended (nbval, a grader) shows a real session;
- when pdb stops asking (``c``, ``q``, the call ends) the rank publishes
  ``{"seq": n, "done": True}``: the kernel serves one rank's session at a
  time, and moves to another rank waiting at a prompt only then.

The answer travels by file because the kernel has no other way into a rank
busy running a cell (ipyparallel's channels to it are queued behind the
cell). The file lives beside the rank's stack dumps, so it works on a lab on
this machine; on a multi-host lab the kernel cannot reach the rank's folder
and says so.

``breakpoint()`` (the builtin) and ``pdb.set_trace()`` on a rank are this same
debugger: ``settle`` points ``sys.breakpointhook`` and ``pdb.set_trace`` here,
since the engine's own stdin is empty and plain pdb would read an end of file
and quit at once. ``where``, ``u`` and ``d`` see only the user's frames (the
engine's and ipyparallel's ~30 frames below a cell are hidden), and pdb's
``interact`` is refused with a line saying what to do instead: its console
would read the engine's stdin, which no one can type into.

The debugger stops only in the user's code (``where.is_user_code``: rank cells
and the user's own files), never in torch, ddplab or the engine's machinery:
``n`` off the end of a cell ends the session instead of wandering into
ipyparallel, and ``s`` on ``dist.all_reduce(t)`` steps over the library.

Outside a lab (a script, under torchrun in a terminal) ``breakpoint()`` is
plain pdb on the terminal.
"""

from __future__ import annotations

import bdb
import json
import os
import pdb
import sys
import time
import traceback
from types import FrameType
from typing import Any, Callable

from ..errors import ConfigError
from . import live, where

#: The key of a debugger request (or its end) in the rank's published data.
REQUEST_KEY = "ddplab_pdb"
#: Seconds between two looks for the kernel's answer.
POLL = 0.05
#: What ``q`` says; the kernel shows it as the rank's error.
QUIT_MESSAGE = ("ddplab: rank {rank}: you quit the debugger (q), so the cell stopped there. "
                "To look and then let the cell run on, use c (continue) instead.")
_state: dict[str, Any] = {"debugger": None, "seq": 0, "traceback": None, "rank": None, "folder": None}


def settle(rank: int, folder: str) -> None:
    """This process is rank ``rank`` of a lab; answers come into ``folder`` (the engine calls this)."""
    _state["rank"], _state["folder"] = rank, folder
    # The builtin breakpoint() and pdb.set_trace() would read the engine's empty stdin.
    sys.breakpointhook = _builtin_breakpoint
    pdb.set_trace = _set_trace


def _builtin_breakpoint(*args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` on a rank: ``ddplab.breakpoint()`` at the caller's line."""
    _stop(sys._getframe(1), None)


def _set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` on a rank: ``ddplab.breakpoint()`` at the caller's line."""
    _stop(sys._getframe(1), None, header)


def settled_rank() -> int | None:
    """The rank ``settle`` made this process, in or out of a process group; None before."""
    return _state["rank"]


class Channel:
    """pdb's stdin and stdout on a rank: lines to and from the notebook kernel."""

    def __init__(self, rank: int, publish: Callable[[dict], None], answer_path: str,
                 commands: list[str] | None = None) -> None:
        self.rank = rank
        self.commands = list(commands or [])   # answers given up front, used first
        self.prompt = f"(Pdb rank {rank}) "
        self._publish = publish
        self._answer_path = answer_path
        self._out: list[str] = []
        self.open = False               # a request was sent and no "done" since

    # -- pdb's stdout
    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    # -- pdb's stdin
    def readline(self) -> str:
        """Send what pdb wrote (ending with its prompt); return the line the notebook's user typed."""
        seq = _next_seq()
        text = self._take()
        prompt = self.prompt if text.endswith(self.prompt) else ""
        self.open = True
        request = {"seq": seq, "rank": self.rank, "text": text[:len(text) - len(prompt)],
                   "prompt": prompt or self.prompt, "answer": self._answer_path,
                   "since": time.time()}      # the kernel counts the wait as the user's
        if self.commands:
            request["given"] = self.commands.pop(0)
        self._publish({REQUEST_KEY: request})
        try:
            line = self._await(seq)
        except KeyboardInterrupt:
            # Kernel > Interrupt: pdb would catch this and ask again, and
            # again; end the debugging (EOF quits) so the rank stops.
            return ""
        return "" if line is None else line + "\n"

    def done(self) -> None:
        """Tell the kernel this rank no longer asks (``c``, ``q``, the call ended)."""
        if self.open:
            self.open = False
            self._publish({REQUEST_KEY: {"seq": _next_seq(), "rank": self.rank, "done": True,
                                         "text": self._take()}})

    def _take(self) -> str:
        text = "".join(self._out)
        self._out.clear()
        return text

    def _await(self, seq: int) -> str | None:
        while True:
            try:
                with open(self._answer_path, encoding="utf-8") as f:
                    answer = json.load(f)
            except (FileNotFoundError, ValueError):
                answer = None            # not written yet (the kernel replaces it whole)
            if answer is not None and answer.get("seq") == seq:
                os.remove(self._answer_path)
                return answer.get("line")
            time.sleep(POLL)


class Debugger(pdb.Pdb):
    """``pdb.Pdb`` on a ``Channel``, stopping only in the user's code, its prompt naming the rank."""

    def __init__(self, channel: Channel) -> None:
        # nosigint: SIGINT on an engine is Kernel > Interrupt, ddplab's to handle.
        super().__init__(stdin=channel, stdout=channel, nosigint=True, readrc=False)
        self.channel = channel
        self.prompt = channel.prompt
        self.quit_asked = False

    def stop_here(self, frame: FrameType) -> bool:
        return where.is_user_code(frame.f_code.co_filename) and super().stop_here(frame)

    # The engine runs a cell's last expression in a code object of its own (to
    # show its value), so a cell's body "returns" just before it and the
    # expression is "called": stops there would show lines the cell is not at.
    # Stepping goes on to the expression's line, or ends with the cell.
    def user_call(self, frame: FrameType, argument_list: object) -> None:
        if not _cell_body(frame):
            super().user_call(frame, argument_list)

    def user_return(self, frame: FrameType, return_value: object) -> None:
        if _cell_body(frame):
            self.set_step()
            return
        super().user_return(frame, return_value)

    def get_stack(self, f: FrameType | None, t: Any) -> tuple[list, int]:
        """pdb's stack, less the frames that are not the user's (``where``, ``u``, ``d``).

        The frame pdb is at stays, even in a library (a post-mortem of an
        error raised inside torch), so ``l`` and ``p`` still look there.
        """
        stack, index = super().get_stack(f, t)
        kept = [i for i, (frame, _) in enumerate(stack)
                if i == index or where.is_user_code(frame.f_code.co_filename)]
        return [stack[i] for i in kept], kept.index(index) if index in kept else len(kept) - 1

    def do_interact(self, arg: str) -> None:
        """interact: refused on a rank (see the module's docstring)."""
        self.message("ddplab: interact is not available on a rank: its console would read the "
                      "engine's stdin, which no one can type into. Type Python at this prompt "
                      "instead (x = 2, print(x), import torch): it runs in this frame.")

    def set_continue(self) -> None:
        super().set_continue()
        self.channel.done()

    def set_quit(self) -> None:
        self.quit_asked = True
        super().set_quit()
        self.channel.done()


def _cell_body(frame: FrameType) -> bool:
    """Whether ``frame`` runs a rank cell's top level (not a function the cell defined)."""
    return frame.f_code.co_name == "<module>" and frame.f_code.co_filename.startswith(where.CELL_PREFIX)


def _next_seq() -> int:
    _state["seq"] += 1
    return _state["seq"]


def _debugger(commands: list[str] | None = None) -> Debugger | None:
    """A debugger talking to the kernel, or None outside a lab (no kernel to ask)."""
    publish, rank, folder = live.publisher(), _state["rank"], _state["folder"]
    if publish is None or rank is None or folder is None:
        return None
    debugger = Debugger(Channel(rank, publish, os.path.join(folder, f"pdb-rank{rank}.answer"),
                                commands))
    _state["debugger"] = debugger
    return debugger


def breakpoint(rank: int | None = None,   # ddplab.breakpoint: named as the builtin on purpose
               commands: list[str] | tuple[str, ...] | None = None) -> None:
    """Stop this rank in pdb at the next line, its prompt in the notebook: ``(Pdb rank 1)``.

    ``rank``: stop only on that rank (the others run on); ``None`` stops every
    rank that gets here, and the notebook serves them one at a time. ``p x``,
    ``n``, ``s``, ``l`` as in pdb; ``c`` lets the cell run on; ``q`` stops the
    cell (ranks waiting for this one in a collective then need
    ``lab.restart()``: use ``c`` to leave them be).

    ``commands``: pdb commands to run first, as if typed at the prompts, e.g.
    ``["p x", "n", "p y", "c"]`` (like ``python -m pdb -c``). The notebook shows
    each after its prompt; once they run out the prompt asks as usual. A
    session that ends with ``c`` needs no one at the keyboard: a notebook run
    unattended (nbval, a grader) or a demo replayed in class shows it whole.
    """
    if commands is not None and (isinstance(commands, str) or
                                 not all(isinstance(c, str) for c in commands)):
        raise TypeError(f"ddplab.breakpoint: commands must be a list of pdb command lines, "
                        f"like ['p x', 'n', 'c'], but got {commands!r}. Put a single command "
                        f"in a list: commands=[{commands!r}].")
    world = _world_size()
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or (world is not None and not 0 <= rank < world)):
        # Silently skipped, a typo would stop no rank at all and look like a bug in pdb.
        ranks = f"one of 0..{world - 1}" if world else "a rank number (an int)"
        raise ConfigError(f"ddplab.breakpoint(rank={rank!r}): no rank has that number here. Name "
                          f"{ranks}, or leave rank out to stop every rank.")
    if rank is not None and rank != _my_rank():
        return
    _stop(sys._getframe(1), list(commands or []))


def _stop(frame: FrameType, commands: list[str] | None, header: str | None = None) -> None:
    """Stop in the debugger at ``frame``: the notebook's prompt on a rank, else the terminal's."""
    debugger = _debugger(commands)
    if debugger is None:
        terminal = pdb.Pdb()             # a script in a terminal: pdb as usual
        terminal.cmdqueue.extend(commands or [])
        terminal.set_trace(frame)
        return
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def _world_size() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    size = os.environ.get("WORLD_SIZE", "")
    return int(size) if size.isdigit() else None


def _my_rank() -> int | None:
    rank = _state["rank"]
    if rank is None and os.environ.get("RANK", "").isdigit():
        rank = int(os.environ["RANK"])   # a script under torchrun
    return rank


def trace_cell() -> None:
    """``%%rank N --pdb``: stop at the first line of the user's code that runs from here."""
    debugger = _debugger()
    if debugger is None:
        return
    debugger.reset()                     # stopframe None: the first user line stops
    sys.settrace(debugger.trace_dispatch)


def end() -> None:
    """The rank's call is over: stop tracing and tell the kernel no more prompts come."""
    debugger = _state["debugger"]
    if debugger is None:
        return
    _state["debugger"] = None
    sys.settrace(None)
    # set_trace gave every frame up the stack (the engine's event loop too) a
    # trace function; left there, each of their lines would be traced forever.
    frame = sys._getframe()
    while frame is not None:
        frame.f_trace = None
        frame = frame.f_back
    debugger.channel.done()


def quit_error(exc: BaseException) -> str | None:
    """The message for a cell ended by ``q`` in the debugger, or None for any other error."""
    if not isinstance(exc, bdb.BdbQuit):
        return None
    return QUIT_MESSAGE.format(rank=_my_rank())


def keep(exc: BaseException, keep_frame: Callable[[str], bool]) -> None:
    """Keep the traceback of a call that raised, for a post-mortem (``%ddplab_debug``).

    Leading frames that are not the user's (``keep_frame`` False: ddplab's
    engine) are dropped, as in the traceback shown. Held until the next
    failure, as IPython holds ``sys.last_traceback``.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and not keep_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    _state["traceback"] = (exc, tb)


def post_mortem() -> None:
    """pdb in the frames of this rank's last error, its prompt in the notebook."""
    kept = _state["traceback"]
    if kept is None:
        raise LookupError(f"ddplab: rank {_my_rank()} has no error to debug: none of its calls "
                          f"raised since the lab started. Run the failing cell first.")
    exc, tb = kept
    debugger = _debugger()
    if debugger is None:
        raise RuntimeError("ddplab: post-mortem debugging needs a rank of a running lab.")
    debugger.channel.write("".join(traceback.format_exception_only(type(exc), exc)))
    try:
        debugger.reset()
        debugger.interaction(None, tb)   # at the innermost frame, as pdb.post_mortem
    finally:
        end()
