"""Code that runs inside the engines, one per rank.

The kernel calls these through ipyparallel's ``apply``. Each call returns plain
data (a dict), never raises on a user error: the kernel turns a returned
failure into ``RankError``. That keeps "your code failed on rank 1" apart from
"the engine itself is broken".

Output of a cell is recorded here, in the order it was produced on this rank
(stdout, stderr and rich display interleaved), and replayed by the kernel
under a ``[rank N]`` label, in rank order. That is what makes the notebook's
stored output identical from run to run.
"""

from __future__ import annotations

import ast
import datetime
import faulthandler
import linecache
import os
import re
import signal
import sys
import traceback
from typing import Any, Callable

#: Filenames of cells compiled on a rank look like this; the hang diagnosis
#: finds the cell's line in a stack dump by this prefix.
CELL_FILENAME = "<rank cell {n}>"
_SITE_PACKAGES = re.compile(r'[^"\s]*?site-packages/')
_state: dict[str, Any] = {"cells": 0, "store": None, "stack_file": None}


def _shell():
    from IPython import get_ipython
    return get_ipython()


def namespace() -> dict:
    """The rank's interactive namespace: the engine's IPython user_ns."""
    shell = _shell()
    return shell.user_ns if shell is not None else globals().setdefault("_user_ns", {})


def open_store(host: str, world_size: int, timeout_s: float) -> int:
    """On rank 0: start the TCPStore that every rank meets at; return its port.

    Binding port 0 lets the OS pick a free port, so two labs started at the
    same moment can never collide on MASTER_PORT.
    """
    import socket

    import torch.distributed as dist
    # TCPStore binds every interface whatever host it is given; a socket we
    # bind ourselves keeps the store on ``host`` (loopback for a local lab).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    # Keep the socket object: if it were garbage-collected it would close the
    # file descriptor the store now listens on.
    _state["store"], _state["listener"] = store, listener
    return store.port


def join_group(rank: int, world_size: int, env: dict[str, str], backend: str,
               timeout_s: float, stack_file: str, kernel_path: list[str] = (),
               init_method: str | None = None) -> dict:
    """Set this rank's torchrun-style env, then ``init_process_group``.

    ``kernel_path`` is the notebook kernel's ``sys.path``: a function the
    kernel imported from a module can then be imported, and so run, here too.

    ``init_method`` is None for ddplab's default (meet at the TCPStore that
    ``open_store`` started), or a URL torch resolves itself: ``"env://"``
    (reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment),
    ``"tcp://host:port"`` or ``"file:///path"`` (these two need rank and
    world_size passed in).

    Also registers a faulthandler on SIGUSR1, so the kernel can ask a stuck
    rank where it is, even while it is blocked inside a C++ collective.
    """
    os.environ.update(env)
    sys.path.extend(p for p in kernel_path if p not in sys.path)
    import torch
    import torch.distributed as dist
    stack = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    _state["stack_file"] = stack
    if backend == "nccl":
        # One GPU per rank; must happen before the group touches CUDA.
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method == "env://":
        # Exactly what a script under torchrun does: everything comes from os.environ.
        dist.init_process_group(backend, init_method=init_method, timeout=timeout)
    elif init_method is not None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        store = _state["store"]
        if store is None:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                                  is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    namespace().update(rank=rank, world_size=world_size, torch=torch, dist=dist)
    return {"rank": dist.get_rank(), "pid": os.getpid()}


class _Recorder:
    """Collects a cell's output as an ordered list of events.

    Events are ``("stdout", text)``, ``("stderr", text)`` and
    ``("display", data, metadata)``; adjacent text of one stream is merged.
    """

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def text(self, stream: str, data: str) -> None:
        if not data:
            return
        if self.events and self.events[-1][0] == stream:
            self.events[-1] = (stream, self.events[-1][1] + data)
        else:
            self.events.append((stream, data))

    def display(self, data: dict, metadata: dict | None) -> None:
        self.events.append(("display", data, metadata or {}))


class _Stream:
    def __init__(self, recorder: _Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def write(self, data: str) -> int:
        self.recorder.text(self.name, data)
        return len(data)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _capture:
    """Context manager: route print, warnings and display() into a _Recorder."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> _Recorder:
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Stream(self.recorder, "stdout"), _Stream(self.recorder, "stderr")
        shell = _shell()
        if shell is not None:
            self.saved_publish = shell.display_pub.publish
            recorder = self.recorder
            shell.display_pub.publish = (
                lambda data, metadata=None, *a, **k: recorder.display(data, metadata))
        return self.recorder

    def __exit__(self, *exc) -> None:
        sys.stdout, sys.stderr = self.saved
        shell = _shell()
        if shell is not None:
            shell.display_pub.publish = self.saved_publish


def _format_error(exc: BaseException, keep: Callable[[str], bool]) -> str:
    """A plain-text traceback with ddplab's own frames removed."""
    tb = exc.__traceback__
    frames = traceback.extract_tb(tb)
    # Drop leading frames that are ddplab's machinery, keep the user's code.
    while tb is not None and frames and not keep(frames[0].filename):
        tb, frames = tb.tb_next, frames[1:]
    return relative_to_site_packages("".join(traceback.format_exception(type(exc), exc, tb)).rstrip())


def relative_to_site_packages(text: str) -> str:
    """Cut every path in ``text`` down to the part after ``site-packages/``.

    Library paths differ per machine; relative to site-packages they do not,
    so a stored traceback or stack compares equal everywhere.
    """
    return _SITE_PACKAGES.sub("", text)


def _is_user_file(filename: str) -> bool:
    return filename != __file__


def _display_value(value: Any) -> None:
    if value is None:
        return
    shell = _shell()
    if shell is not None:
        data, metadata = shell.display_formatter.format(value)
        shell.display_pub.publish(data=data, metadata=metadata)
    else:
        print(repr(value))


def run_cell(source: str) -> dict:
    """Run notebook cell source in this rank's namespace, like a Python prompt.

    IPython syntax (``%time``, ``!ls``) works; the last expression's value is
    displayed. Returns ``{"ok", "events", "error"}``.
    """
    _state["cells"] += 1
    filename = CELL_FILENAME.format(n=_state["cells"])
    shell = _shell()
    code = shell.transform_cell(source) if shell is not None else source
    # Register the source so tracebacks and stack dumps can show cell lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    recorder = _Recorder()
    error = None
    with _capture(recorder):
        try:
            tree = ast.parse(code, filename)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            ns = namespace()
            exec(compile(tree, filename, "exec"), ns)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
                _display_value(value)
        except BaseException as exc:  # KeyboardInterrupt too: it is the rank's outcome
            error = _format_error(exc, _is_user_file)
    return {"ok": error is None, "events": recorder.events, "error": error}


def call(fn: Callable, args: tuple, kwargs: dict) -> dict:
    """Call ``fn(*args, **kwargs)`` with its output recorded; see run_cell."""
    recorder = _Recorder()
    value, error = None, None
    with _capture(recorder):
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            error = _format_error(exc, _is_user_file)
    return {"ok": error is None, "events": recorder.events, "error": error, "value": value}


def pid() -> int:
    return os.getpid()
