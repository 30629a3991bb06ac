"""Where is a stuck rank? Read its Python stack without stopping it.

Each rank registers ``faulthandler`` on SIGUSR1 when it joins the group
(see ``engine.join_group``). faulthandler runs in C, so it answers even when
the rank's main thread is blocked inside a C++ collective and no Python code
can run there. We send the signal, read the dump the rank wrote to its stack
file, and boil it down to one line such as ``in all_reduce (cell line 3)``.
Which call and which line, and the words for them, are ``ddplab.rank.where``'s:
the live status and the trace say it the same way.
"""

from __future__ import annotations

import os
import re
import signal
import time

from .. import procs
from ..rank.engine import relative_to_site_packages
from ..rank.where import CELL_PREFIX, is_user_code, locate
from ..text import plural

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')
#: A frame of a Python traceback (a comma before "in", unlike faulthandler's).
_TRACEBACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
#: What gloo raises in a rank whose peer's end of a connection went away: the peer's group
#: closed (its code returned, and ddplab or the process ending destroyed it) or its process died.
PEER_CLOSED = ("Connection closed by peer", "Connection reset by peer")
#: What torch puts before each line a torchrun worker's uncaught error writes: ``[rank0]:``.
_LOG_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def dump_stack(process: procs.Member, stack_file: str, deadline: float) -> str:
    """Ask a rank's process (pid or psutil handle) for its stacks; the dump ("" if none came)."""
    try:
        start = os.path.getsize(stack_file)
    except OSError:
        return ""
    if not procs.send(process, signal.SIGUSR1):
        return ""
    size, stable_since = start, None
    # faulthandler writes in a few bursts; wait until the file stops growing.
    while time.monotonic() < deadline:
        now = os.path.getsize(stack_file)
        if now > size:
            size, stable_since = now, time.monotonic()
        elif stable_since and time.monotonic() - stable_since > 0.1:
            break
        time.sleep(0.02)
    with open(stack_file, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        return f.read()


def main_thread_stack(dump: str) -> list[tuple[str, int, str]]:
    """Frames ``(file, line, function)`` of the thread running user code, innermost first.

    faulthandler prints every thread; the one we want is the thread whose
    stack contains a rank cell, or else the one marked as the current thread's
    peer "Thread ... (most recent call first)" that holds the most frames.
    """
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            threads.append([])
            continue
        match = _FRAME.match(line)
        if match and threads:
            threads[-1].append((match["file"], int(match["line"]), match["func"]))
    for frames in threads:
        if any(f.startswith(CELL_PREFIX) for f, _, _ in frames):
            return frames
    for frames in threads:
        if any("/torch/distributed/" in f for f, _, _ in frames):
            return frames
    return max(threads, key=len, default=[])


def where(frames: list[tuple[str, int, str]]) -> str:
    """One line: the torch.distributed call a rank is in, and where the user called it.

    >>> where([(".../torch/distributed/distributed_c10d.py", 9, "send"),
    ...        ("<rank cell 2>", 3, "<module>")])
    'in send (cell line 3)'
    """
    return locate(frames).in_call()


def format_stack(frames: list[tuple[str, int, str]], limit: int = 8) -> str:
    """The frames from the user's line inward, outermost first, like a traceback.

    The user's frame (the one ``where()`` names) always shows; past ``limit``
    frames, those just inside it are left out, the innermost kept.
    """
    if not frames:
        return ""
    outer = locate(frames).line_at
    shown = frames[:len(frames) if outer is None else outer + 1]
    lines = [f'    File "{path}", line {line}, in {func}' for path, line, func in shown]
    if len(lines) > limit:
        lines = lines[:limit - 1] + ["    ..."] + lines[-1:]
    return relative_to_site_packages("\n".join(reversed(lines)))


def waiting_to_join(where_line: str) -> bool:
    """Is a rank, by its ``where()`` line, waiting in ``init_process_group``?"""
    return where_line.startswith("in init_process_group")


def joining_message(ranks: list[int], world_size: int) -> str:
    """What a ``%%rank`` cell says when it returns while its ranks wait for the group to fill."""
    many = len(ranks) > 1
    names = ", ".join(map(str, ranks))
    return (f"ddplab: {plural(len(ranks), 'rank')} {names} {'are' if many else 'is'} waiting in "
            f"init_process_group for the other ranks to join. {'They keep' if many else 'It keeps'} "
            f"running: run the matching init_process_group on the other ranks, and the group "
            f"completes on all of them. The output appears under the next ddplab cell that "
            f"finishes, or call lab.wait().")


def join_hint(world_size: int) -> str:
    """Why ranks stay in ``init_process_group``, for a HangError."""
    return ("Ranks waiting in init_process_group are waiting for the group to fill: it completes "
            "only when world_size ranks have called it, each with a different rank, at the same "
            "meeting point (MASTER_ADDR:MASTER_PORT, the tcp:// address, or the file:// path). "
            "That usually means one of: a world_size larger than the number of ranks that call it "
            f"(this lab has {world_size}); a rank that has not run its init_process_group yet; "
            "ranks given different ports, addresses or files (or a file left over from an "
            "earlier group); two ranks that claimed the same rank.")


def activity(frames: list[tuple[str, int, str]]) -> tuple[bool, str]:
    """Whether a running rank is inside a torch.distributed call, and where it is.

    ``(True, "in send (cell line 1)")`` for a rank blocked in a send;
    ``(False, "at cell line 3")`` for one sleeping or computing in a cell.
    """
    found = locate(frames)
    return found.in_dist, found.doing()


def fatal_where(stack_file: str) -> str:
    """Where a rank was when a fatal signal ended it, from the dump faulthandler left ("" if none).

    ``engine`` enables faulthandler for fatal signals on the rank's stack file,
    so an abort inside gloo leaves the stacks of every thread there, after a
    ``Fatal Python error`` line.
    """
    try:
        with open(stack_file, encoding="utf-8", errors="replace") as f:
            dump = f.read()
    except OSError:
        return ""
    start = dump.rfind("Fatal Python error")
    if start < 0:
        return ""
    frames = main_thread_stack(dump[start:])
    return locate(frames).doing() if frames else ""


#: The calls a message between two ranks goes through, as ``where`` names them.
_P2P_CALLS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
              "recv_object_list")
_MISMATCH_FIX = ("The receive buffer must have the sender's dtype and number of elements: a "
                 "float buffer (torch.zeros(3) is float32) receiving an int tensor "
                 "(torch.tensor([1, 2, 3]) is int64), or the reverse, is a dtype mismatch; "
                 "make it with the sender's dtype, e.g. torch.zeros(3, dtype=torch.int64). "
                 "(Two dtypes of the same size, float32 and int32, are not caught: the bytes "
                 "arrive and are read as the other type.)")


def death(ended: dict, where_line: str = "") -> str:
    """Why an engine died, from how it ended (``{"exit": code}`` or ``{"signal": n}``).

    ``where_line`` is where the rank was, when known (``fatal_where``): an abort
    in a send or receive is then named as the dtype or size mismatch it almost
    always is. The sentence follows "the engine of rank 1 ...".
    """
    if "exit" in ended:
        return (f"exited with code {ended['exit']} (the rank's code, or a library it called, "
                f"ended the process: os._exit, sys.exit in a thread, or a fatal error).")
    number = ended.get("signal")
    if number is None:
        return "died (its exit status is unknown: killed, or out of memory)."
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    if number == signal.SIGKILL:
        return (f"was killed ({name}): most likely out of memory (the kernel's OOM killer; "
                f"see dmesg), or a kill -9.")
    if number == signal.SIGSEGV:
        return (f"crashed ({name}, a segmentation fault): a bug in C/C++ code, or a C "
                f"extension given memory it must not touch.")
    if number == signal.SIGABRT:
        call, at = _call(where_line), f" {where_line}" if where_line else ""
        if call in _P2P_CALLS:
            return (f"aborted ({name}){at}: a dtype or size mismatch between a send and its "
                    f"receive. gloo ends the process when a message does not fit the buffer "
                    f"it is received into. {_MISMATCH_FIX}")
        if call:
            return (f"aborted ({name}){at}: a C++ error inside torch. In a collective this "
                    f"usually means the ranks passed tensors of different shapes or dtypes; "
                    f"run it again in ddplab.start(debug=True), which checks every collective "
                    f"and names the mismatch.")
        return (f"aborted ({name}){at}: a C++ error inside torch, most often a dtype or size "
                f"mismatch between ranks. Between a send (or isend) and its receive, gloo "
                f"ends the process when a message does not fit its buffer. {_MISMATCH_FIX} "
                f"In a collective, run it again in ddplab.start(debug=True), which names the "
                f"mismatch.")
    return f"was ended by {name}."


def waited_when_peer_left(text: str) -> str:
    """Where a rank waited when gloo ended its call because a peer left, from the (last)
    traceback in ``text`` (a rank's error, or a launched process's output, ``[rank0]:``
    prefixes and all): ``in all_reduce (job line 8)``; "" unless that traceback ends in gloo's
    "Connection closed by peer" (or reset) raised in a torch.distributed call."""
    lines = [_LOG_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return ""
    body = lines[starts[-1] + 1:]
    error = next((line for line in body if line and not line[0].isspace()), "")
    if not any(mark in error for mark in PEER_CLOSED):
        return ""
    frames = []
    for line in body[:body.index(error)]:
        match = _TRACEBACK_FRAME.search(line)
        if match:                # tracebacks shorten site-packages paths: torch/distributed/...
            path = match["file"]
            path = path if os.path.isabs(path) or path.startswith("<") else "/" + path
            frames.append((path, int(match["line"]), match["func"]))
    found = locate(reversed(frames))
    return found.in_call() if found.in_dist else ""


def peer_left(waited: dict[int, str], left: list[int], how: str = "finished") -> str:
    """The verdict for ranks whose torch.distributed call gloo ended because ranks ``left``
    (``how``: "finished", "returned") without making it; ``waited``: where each
    waited (``waited_when_peer_left``). "" when there is nothing to say."""
    if not waited or not left:
        return ""
    ranks = sorted(waited)
    one, gone_one = len(ranks) == 1, len(left) == 1
    where = (waited[ranks[0]] if one else
             "; ".join(f"rank {rank} {waited[rank]}" for rank in ranks))
    gone = f"{plural(len(left), 'rank')} {', '.join(map(str, left))}"
    return (f"ddplab: {plural(len(ranks), 'rank')} {', '.join(map(str, ranks))} waited {where} "
            f"for {gone}, which {how} without making that call: when "
            f"{'its' if gone_one else 'their'} process group closed, gloo ended the wait with "
            f"\"Connection closed by peer\" (no rank crashed). Every rank must make the same "
            f"torch.distributed calls in the same order, each send with its recv: look for a "
            f"call skipped behind an `if rank == ...`, or fewer loop steps.")


def headline(busy: list[int], others: list[int], timeout: float) -> str:
    """What a hang report says first: a deadlock only when no rank is busy in its own code."""
    if not busy:
        return "ranks are probably waiting for each other (a deadlock)."
    them = f"{plural(len(busy), 'rank')} {', '.join(map(str, busy))}"
    is_, its = ("is", "its") if len(busy) == 1 else ("are", "their")
    if not others:
        return (f"no rank is waiting for another: {them} {is_} still running {its} "
                f"own code (an endless loop, or work longer than the timeout: pass a longer timeout=, "
                f"more than {timeout:g} s, if it is just slow).")
    return (f"{plural(len(others), 'rank')} {', '.join(map(str, others))} "
            f"{'waits' if len(others) == 1 else 'wait'} for {them}, which {is_} still running "
            f"{its} own code, not a torch.distributed call: a slow "
            f"rank (pass a longer timeout=) or one that never reaches the call the others wait in.")


def busy_in_own_code(stack: str) -> bool:
    """Whether a still-running rank runs its own code: its innermost frame is the user's
    (``_own``): a cell's line, a function the notebook sent (``lab.run``, ``lab.spawn``), a
    module of theirs (sleeping, spinning, computing in plain Python, loading the next batch).

    A rank whose innermost frame is a library's (autograd's backward, where DDP's reducer may
    wait for the others in C++; a queue of the standard library) is not called busy: from its
    stack alone it could be waiting.
    """
    # A torch.distributed call's innermost frames are torch's (its Python wrapper): not own.
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith('File "')]
    return bool(frames) and _own(frames[-1])


def _own(frame: str) -> bool:
    """Whether a stack line (``File "path", line N, in f``) is in the user's code
    (``where.is_user_code``). A stack's site-packages paths come shortened
    (``torch/autograd/graph.py``): a relative one is a library's."""
    path = frame[len('File "'):].split('"', 1)[0]
    return (path.startswith(CELL_PREFIX) or os.path.isabs(path)) and is_user_code(path)


def _call(where_line: str) -> str:
    """The call a ``where`` line names: ``"recv"`` for ``"in recv (cell line 3)"``; "" if none."""
    call = where_line[3:].split(" (")[0] if where_line.startswith("in ") else ""
    return "" if call.startswith("<") else call


#: What a rank stuck in DDP's constructor is told (``check.nb05_ddp_training`` says the same of a check).
DDP_IS_A_COLLECTIVE = (
    "DDP(model) is itself a collective: the constructor checks that every rank's parameters "
    "have the same shapes and broadcasts rank 0's weights to all, so it returns only once every "
    "rank has called it; made on one rank alone it waits for the others for ever. Construct it "
    "on every rank at once: a %%ranks cell, not %%rank 0 and not under `if rank == 0:`.")


def deadlock_hint(states: dict[int, str], where: dict[int, str], stacks: dict[int, str]) -> str:
    """The likely cause of a hang, from where each rank waits ("" when no pattern fits).

    ``states`` is each rank's "still running" / "finished" / "failed", ``where``
    the still-running ranks' ``where`` lines and ``stacks`` their formatted stacks.
    """
    if any("nn/parallel/distributed.py" in stack for stack in stacks.values()):
        inside = sorted(rank for rank, stack in stacks.items()
                        if "nn/parallel/distributed.py" in stack)
        return (f"Hint: {plural(len(inside), 'rank')} {', '.join(map(str, inside))} "
                f"{'are' if len(inside) > 1 else 'is'} inside DDP(model). {DDP_IS_A_COLLECTIVE}")
    calls = {rank: _call(line) for rank, line in where.items()}
    if not calls:
        return ""
    if all(call == "recv" for call in calls.values()) and len(calls) == len(states):
        return ("Hint: every rank is waiting in recv, and no rank is sending: a recv returns only "
                "once the matching send is made, so ranks that all receive first wait for each "
                "other for ever. One rank must send first (around a ring: rank 0 sends, then "
                "receives last; every other rank receives, then sends).")
    if all(call == "send" for call in calls.values()) and len(calls) == len(states):
        return ("Hint: every rank is waiting in send: gloo's blocking send returns only once the "
                "matching recv is posted, so ranks that all send first wait for each other for "
                "ever. Let one side receive first (e.g. even ranks send then receive, odd ranks "
                "receive then send), or use dist.isend / dist.irecv and wait() on both.")
    if all(call == "Work.wait" for call in calls.values()):
        return ("Hint: every rank still running waits in .wait() on the handle an isend or irecv "
                "(or a call with async_op=True) returned: it returns only once its message is "
                "through, so the matching irecv or isend is missing, names another rank (dst=, "
                "src=), or has another tag. Check each pair: same ranks, same tag, same size and "
                "dtype.")
    idle = sorted(rank for rank, state in states.items() if state != "still running")
    if all(call in ("send", "recv") for call in calls.values()):
        if idle:
            return (f"Hint: ranks wait in send/recv for {plural(len(idle), 'rank')} "
                    f"{', '.join(map(str, idle))}, which finished the cell: check that every "
                    f"send has its recv on the rank it names (dst=/src=), and that no rank skips "
                    f"its part behind an `if rank == ...`.")
        return ""
    # A collective skipped or mismatched is the flight recorder's to say (``flight.report``); it
    # does not see new_group, whose gloo set-up waits for every member of the new group.
    if idle and all(call == "new_group" for call in calls.values()):
        waiting = sorted(calls)
        return (f"Hint: {plural(len(waiting), 'rank')} {', '.join(map(str, waiting))} "
                f"{'wait' if len(waiting) > 1 else 'waits'} in new_group for "
                f"{plural(len(idle), 'rank')} {', '.join(map(str, idle))}, which finished the cell "
                f"without calling it. new_group is itself a collective of all ranks: every rank "
                f"calls it for every group, the groups it is not in too, in the same order.")
    return ""

