"""Where is a stuck rank? Read its Python stack without stopping it.

Each rank registers ``faulthandler`` on SIGUSR1 when it joins the group
(see ``engine.join_group``). faulthandler runs in C, so it answers even when
the rank's main thread is blocked inside a C++ collective and no Python code
can run there. We send the signal, read the dump the rank wrote to its stack
file, and boil it down to one line such as ``in all_reduce (cell line 3)``.
"""

from __future__ import annotations

import os
import re
import signal
import time

from .engine import CELL_FILENAME, relative_to_site_packages

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')
_CELL_PREFIX = CELL_FILENAME.split("{")[0]
# Frames in these files are plumbing between the user's call and the real one.
_WRAPPERS = {"wrapper", "_wrapper", "inner", "_inner"}


def dump_stack(pid: int, stack_file: str, deadline: float) -> str:
    """Ask process ``pid`` for its stacks; return the dump (empty if none came)."""
    try:
        start = os.path.getsize(stack_file)
        os.kill(pid, signal.SIGUSR1)
    except OSError:
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
        if any(f.startswith(_CELL_PREFIX) for f, _, _ in frames):
            return frames
    for frames in threads:
        if any("/torch/distributed/" in f for f, _, _ in frames):
            return frames
    return max(threads, key=len, default=[])


def _is_library(path: str) -> bool:
    return ("site-packages" in path or "/lib/python" in path or "/ddplab/" in path
            or path.startswith("<frozen"))


def where(frames: list[tuple[str, int, str]]) -> str:
    """One line: the torch.distributed call a rank is in, and where the user called it.

    >>> where([(".../torch/distributed/distributed_c10d.py", 9, "send"),
    ...        ("<rank cell 2>", 3, "<module>")])
    'in send (cell line 3)'
    """
    if not frames:
        return "somewhere (no stack could be read)"
    call = next((func for path, _, func in frames
                 if "/torch/distributed/" in path and func not in _WRAPPERS), None)
    user = next(((path, line, func) for path, line, func in frames
                 if path.startswith(_CELL_PREFIX) or not _is_library(path)), None)
    what = f"in {call}" if call else f"in {frames[0][2]}"
    if user is None:
        return what
    path, line, func = user
    if path.startswith(_CELL_PREFIX):
        return f"{what} (cell line {line})"
    return f"{what} (called from {func}, {os.path.basename(path)} line {line})"


def format_stack(frames: list[tuple[str, int, str]], limit: int = 8) -> str:
    """The frames from the user's code inward, outermost first, like a traceback."""
    outer = next((i for i, (path, _, _) in enumerate(frames)
                  if path.startswith(_CELL_PREFIX) or not _is_library(path)), len(frames) - 1)
    shown = list(reversed(frames[:outer + 1][:limit]))
    return relative_to_site_packages(
        "\n".join(f'    File "{path}", line {line}, in {func}' for path, line, func in shown))
