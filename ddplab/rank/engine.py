"""Code that runs inside the engines, one per rank.

The kernel calls these through ipyparallel's ``apply``. Each call returns plain
data (a dict), never raises on a user error: the kernel turns a returned
failure into ``RankError``. That keeps "your code failed on rank 1" apart from
"the engine itself is broken".

Output of a cell is recorded by ``output`` (``capture``), in the order it
was produced on this rank (stdout, stderr, rich display, and through
``fdcapture`` what bypasses Python: subprocesses, ``os.write``, C++ logs), and
replayed by the kernel under a ``[rank N]`` label, in rank order. That is what
makes the notebook's stored output identical from run to run.
"""

from __future__ import annotations

import ast
import asyncio
import datetime
import faulthandler
import linecache
import os
import signal
import sys
import traceback
from typing import Any, Callable

from ..env import TORCHRUN_VARIABLES
from ..text import plural
from . import awaiting, debugger, flight, fresh, output
from .where import CELL_FILENAME  # "<rank cell 3>": ``where`` owns the spelling

_state: dict[str, Any] = {"cells": 0, "store": None, "stack_file": None}


def _shell():
    from IPython import get_ipython
    return get_ipython()


def namespace() -> dict:
    """The rank's interactive namespace: the engine's IPython user_ns."""
    shell = _shell()
    return shell.user_ns if shell is not None else globals().setdefault("_user_ns", {})


def open_store(host: str, world_size: int, timeout_s: float) -> int:
    """On rank 0 of a multi-host lab: start the TCPStore every rank meets at; return its port.

    Binding port 0 lets the OS pick a free port, so two labs started at the
    same moment can never collide on MASTER_PORT. (A local lab needs no port:
    its ranks meet in a FileStore; see ``join_group``.)
    """
    import socket

    import torch.distributed as dist
    # TCPStore binds every interface whatever host it is given; a socket we
    # bind ourselves keeps the store on ``host`` (loopback for a local lab).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store owns the descriptor from here on, and closes it when it is
    # destroyed; a socket object still holding it would close that number a
    # second time when collected, by then perhaps the next store's listener
    # (a second group on the same engines then never forms).
    fd = listener.detach()
    try:
        store = dist.TCPStore(host, port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    _state["store"] = store
    return store.port


def _watch_stack(stack_file: str, kernel_path: list[str]) -> None:
    """Let the kernel import the notebook's modules here, and ask this rank for its stack.

    faulthandler on SIGUSR1 answers even while the rank is blocked inside a
    C++ collective (or a rendezvous), where no Python code can run.
    """
    sys.path.extend(p for p in kernel_path if p not in sys.path)
    fresh.install()                  # the user's modules imported from now on stay fresh
    stack = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    # A fatal signal (gloo aborts on a message that does not fit its buffer) writes
    # the stacks there too: the kernel then says which call the rank died in.
    faulthandler.enable(file=stack, all_threads=True)
    _state["stack_file"] = stack
    # Which collective this rank is in, for a hang report: torch's flight
    # recorder for the groups made from now on, read on the kernel's request.
    flight.enable()
    flight.serve(stack_file + ".fr", stack_file + ".fr.json")
    _state["in_lab"] = True          # what in_lab() reports, on one host or several
    # From now on what the rank writes to fd 1 and 2 (subprocesses, os.write,
    # gloo's C++ warnings) is shown with its prints, not lost in a log file.
    output.capture_fds()


def in_lab() -> bool:
    """Whether this process is a rank of a ddplab lab (it joined one, with or without a group).

    Every kind of engine says so the same way once the kernel has made it a
    rank, whoever started it (``ddplab.start``, ssh, Slurm, ``ipcluster``).
    """
    return _state.get("in_lab", False)


def stay_bare(stack_file: str, kernel_path: list[str], names: dict[str, Any]) -> int:
    """Get a rank ready without joining any group (``ddplab.start(init_method=None)``).

    torch.distributed is left alone and torchrun's variables are removed from
    the environment, so the student's own ``init_process_group`` is the only
    one. ``names`` (``rank``, ``world_size``, ``port``, ``lab_dir``) go into
    the rank's namespace. Returns the pid.
    """
    for name in TORCHRUN_VARIABLES:       # bare ranks start without them: the student sets them
        os.environ.pop(name, None)
    _watch_stack(stack_file, kernel_path)
    debugger.settle(names["rank"], os.path.dirname(stack_file))
    namespace().update(names)
    return os.getpid()


def join_group(rank: int, world_size: int, env: dict[str, str], backend: str,
               timeout_s: float, stack_file: str, kernel_path: list[str] = (),
               init_method: str | None = None, store_path: str | None = None) -> dict:
    """Set this rank's torchrun-style env, then ``init_process_group``.

    ``kernel_path`` is the notebook kernel's ``sys.path``: a function the
    kernel imported from a module can then be imported, and so run, here too.

    How the ranks meet:

    - ``store_path``: a local lab's default. Every rank opens a ``FileStore``
      on this file, which the kernel made in the lab's owner-only directory,
      and passes it as ``init_process_group(store=...)``. No port: another
      user of the machine cannot reach the rendezvous at all.
    - ``init_method`` None (and no ``store_path``): a multi-host lab's default,
      meet at the TCPStore that ``open_store`` started on rank 0's host.
    - ``init_method`` a URL torch resolves itself: ``"env://"`` (reads RANK,
      WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment),
      ``"tcp://host:port"`` or ``"file:///path"`` (these two need rank and
      world_size passed in).

    Also registers a faulthandler on SIGUSR1, so the kernel can ask a stuck
    rank where it is, even while it is blocked inside a C++ collective.
    """
    os.environ.update(env)
    _watch_stack(stack_file, kernel_path)
    debugger.settle(rank, os.path.dirname(stack_file))
    import torch
    import torch.distributed as dist
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
    elif store_path is not None:
        # The process group keeps the store (new_group, barriers and the
        # checkers' groups meet in it too); the last rank to close it cleanly
        # deletes the file, and lab.stop() removes the directory in any case.
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        store = _state["store"]
        if store is None:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                                  is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    namespace().update(rank=rank, world_size=world_size, torch=torch, dist=dist)
    from . import owngroup
    owngroup.guard()     # a student's own init/destroy_process_group now says what it means
    return {"rank": dist.get_rank(), "pid": os.getpid()}


def _format_error(exc: BaseException, keep: Callable[[str], bool]) -> str:
    """A plain-text traceback with ddplab's own frames removed."""
    tb = exc.__traceback__
    frames = traceback.extract_tb(tb)
    # Drop leading frames that are ddplab's machinery, keep the user's code.
    while tb is not None and frames and not keep(frames[0].filename):
        tb, frames = tb.tb_next, frames[1:]
    return relative_to_site_packages("".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
                                     + _situation_hints(exc))


def _situation_hints(exc: BaseException) -> str:
    from .owngroup import explain  # why there is no default group, if the lab's was destroyed
    return explain(exc) + _self_pair_hint(exc) + _shared_gpu_hint(exc)


def advice(exc: BaseException) -> list[str]:
    """What ddplab says of an error raised on a rank, beyond the error itself: each ``ddplab: ...``
    sentence a traceback from here ends with (``rank`` used inside a function, a rank that sent
    to itself, a destroyed group, a shared GPU), without the prefix. A check shows them as its hint."""
    text = _situation_hints(exc) + _name_hint(exc)
    return [line.removeprefix("ddplab: ") for line in text.splitlines() if line.strip()]


def _self_pair_hint(exc: BaseException) -> str:
    """gloo's words when a rank sends to or receives from itself (torch checks only blocking send)."""
    if "Pair is not connected" not in str(exc) or "<--> [none]" not in str(exc):
        return ""
    return ("\nddplab: this rank sent to or received from itself (a src or dst equal to its own rank): "
            "gloo keeps no connection from a rank to itself. Its own data is already here; name "
            "another rank, e.g. (rank + 1) % world_size.")


def _shared_gpu_hint(exc: BaseException) -> str:
    """nccl's words when two ranks of one group use the same GPU (seen on an H200, NCCL 2.28)."""
    if "Duplicate GPU detected" not in str(exc):
        return ""
    import torch
    gpus = torch.cuda.device_count()
    world = os.environ.get("WORLD_SIZE", "?")
    return (f"\nddplab: two ranks of this group are on one GPU, and nccl needs a GPU of its own for "
            f"each rank. This machine has {gpus} {plural(gpus, 'GPU')} for {world} ranks. Where there "
            f"are enough, give each rank its own: device_id=torch.device('cuda', local_rank) in "
            f"init_process_group, and torch.cuda.set_device(local_rank). Otherwise use the 'gloo' "
            f"backend, which lets ranks share a GPU or use the CPU.")


def relative_to_site_packages(text: str) -> str:
    """Cut every path in ``text`` down to the part after ``site-packages/``.

    Library paths differ per machine; relative to site-packages they do not,
    so a stored traceback or stack compares equal everywhere.
    """
    # One pass, no regex: a pattern like ``[^"\s]*?site-packages/`` retries from every
    # start position, so a 100k-character word (an exception message of one long token)
    # took a minute and 10 MB never ended, with the rank stuck in the formatter.
    marker, kept, start = "site-packages/", [], 0
    while (found := text.find(marker, start)) >= 0:
        cut = found                      # back to the path's start: after a space or a quote
        while cut > start and not text[cut - 1].isspace() and text[cut - 1] != '"':
            cut -= 1
        kept.append(text[start:cut])
        start = found + len(marker)
    kept.append(text[start:])
    return "".join(kept)


def _is_user_file(filename: str) -> bool:
    # A cell that awaits runs under awaiting.run and asyncio's loop: theirs are not the user's.
    return filename not in (__file__, awaiting.__file__) and not filename.startswith(_ASYNCIO)


_ASYNCIO = os.path.dirname(asyncio.__file__) + os.sep


def _display_value(value: Any) -> None:
    if value is None:
        return
    shell = _shell()
    if shell is not None:
        data, metadata = shell.display_formatter.format(value)
        shell.display_pub.publish(data=data, metadata=metadata)
    else:
        print(repr(value))


def _quiet(code: str) -> bool:
    """Whether the cell's last expression ends with ``;`` (comments aside)."""
    try:
        from IPython.core.displayhook import DisplayHook
        return DisplayHook.semicolon_at_end_of_expression(code)
    except (ImportError, AttributeError):
        return code.rstrip().endswith(";")


def run_cell(source: str, pdb: bool = False, kernel_path: list[str] | None = None) -> dict:
    """Run notebook cell source in this rank's namespace, like a Python prompt.

    The user's modules are made fresh first (``fresh.refresh``, with the kernel's
    ``sys.path``). IPython syntax (``%time``, ``!ls``) and top-level ``await`` (``awaiting``) work;
    the last expression's value is displayed. ``pdb``: stop in the debugger at the cell's first line
    (``%%rank N --pdb``; see ``debugger``). Returns ``{"ok", "events", "error"}``.
    """
    _state["cells"] += 1
    filename = CELL_FILENAME.format(n=_state["cells"])
    shell = _shell()
    code = shell.transform_cell(source) if shell is not None else source
    # Register the source so tracebacks and stack dumps can show cell lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    recorder = output.OutputRecorder()
    error = None
    with output.capture(recorder):
        try:
            tree = ast.parse(code, filename)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            ns = namespace()
            fresh.refresh(ns, kernel_path)
            if pdb:
                debugger.trace_cell()
            awaiting.run(awaiting.compile_cell(tree, filename, "exec"), ns)
            if last is not None:
                value = awaiting.run(awaiting.compile_cell(ast.Expression(last.value), filename,
                                                           "eval"), ns)
                if not _quiet(code):         # a trailing ";" hides the value, as in IPython
                    _display_value(value)
        except BaseException as exc:  # KeyboardInterrupt too: it is the rank's outcome
            error = _failed(exc, _is_user_file)
        finally:
            debugger.end()                   # no prompt outlives its cell
    return {"ok": error is None, "events": recorder.events, "error": error}


def _failed(exc: BaseException, keep: Callable[[str], bool]) -> str:
    """The error text of a call that raised; its traceback is kept for a post-mortem."""
    quit = debugger.quit_error(exc)
    if quit is not None:
        return quit                          # q in the debugger: no traceback to show
    if isinstance(exc, fresh.ReloadError):   # the user's file, not ddplab's frames that reloaded it
        return f"{exc}\n{_format_error(exc.__cause__, fresh.users)}"
    debugger.keep(exc, keep)
    return _format_error(exc, keep)


def call(fn: Callable, args: tuple, kwargs: dict,
         sources: dict[str, list[str]] | None = None) -> dict:
    """Call ``fn(*args, **kwargs)`` with its output recorded; see run_cell.

    ``sources``: the lines of files only the kernel has (a function defined in
    a notebook cell), for pdb's ``l`` and tracebacks here.
    """
    return _call(lambda: (fn, args, kwargs), sources)


def call_pickled(pickled: bytes, own: tuple = (), sources: dict[str, list[str]] | None = None,
                 kernel_path: list[str] | None = None) -> dict:
    """A job's call: ``fn(*common, *own, **kwargs)``, ``(fn, common, kwargs)`` pickled once for
    every rank (``own``: this rank's own arguments, as ``Lab.run_each`` and ``lab.spawn`` send).

    The rank's modules are made fresh first (``fresh.refresh``, with the kernel's
    ``sys.path``), then the job is unpickled: a function of the user's own module,
    sent by name, is the one the fresh module holds. See ``call`` for the rest.
    """
    import pickle

    def load() -> tuple[Callable, tuple, dict]:
        fresh.refresh(namespace(), kernel_path)
        fn, common, kwargs = pickle.loads(pickled)
        return fn, (*common, *own), kwargs
    return _call(load, sources)


def _call(load: Callable[[], tuple[Callable, tuple, dict]],
          sources: dict[str, list[str]] | None) -> dict:
    """``fn(*args, **kwargs)`` from ``load()``, both with the output recorded (what a module prints
    as it loads is the job's too); the dict ``call`` returns."""
    for filename, lines in (sources or {}).items():
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    recorder = output.OutputRecorder()
    value, error = None, None
    with output.capture(recorder):
        try:
            fn, args, kwargs = load()
        except BaseException as exc:       # a module that failed to load, a name the file lacks
            error = _failed(exc, _is_user_code) + fresh.explain(exc)
        else:
            try:
                value = fn(*args, **kwargs)
            except BaseException as exc:
                error = _failed(exc, _is_user_code) + _name_hint(exc)
            finally:
                debugger.end()
    if error is None:
        # Checked here, where the rank is known: ipyparallel's own failure to send
        # the value back names an engine id and a bare TypeError.
        value, error = _sendable(value)
    return {"ok": error is None, "events": recorder.events, "error": error, "value": value}


def _is_user_code(filename: str) -> bool:
    """Neither this module nor ``owngroup`` and ``script`` (which run ``lab.spawn`` /
    ``run_script`` code)."""
    return _is_user_file(filename) and not filename.endswith(
        (os.path.join("rank", "owngroup.py"), os.path.join("rank", "script.py")))


def _sendable(value: Any) -> tuple[Any, str | None]:
    """``(value, None)`` if the kernel can receive ``value``; else ``(None, why and the fix)``."""
    import cloudpickle
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        return None, (f"ddplab: the function returned a {kind}, which cannot be sent back to the "
                      f"notebook ({type(exc).__name__}: {exc}). A result travels by pickling; "
                      f"return plain data instead (numbers, strings, lists, dicts, tensors, "
                      f"a model's state_dict()), or keep the object on the rank in a global "
                      f"and return what you need from it.")
    return value, None


def _name_hint(exc: BaseException) -> str:
    """A function written in the kernel sees the kernel's globals, where ``rank`` is not defined."""
    name = getattr(exc, "name", None) if isinstance(exc, NameError) else None
    spelled = {"rank": "dist.get_rank()", "world_size": "dist.get_world_size()"}.get(name)
    if spelled is None:
        return ""
    return (f"\nddplab: a function defined in the notebook kernel runs with the kernel's "
            f"globals, where {name!r} is not defined. Use {spelled} inside the function "
            f"(with import torch.distributed as dist), or pass it in as an argument.")


def pid() -> int:
    return os.getpid()


def leave_group() -> None:
    """Leave the process group, if this engine is in one, and forget the store it opened."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    _state["store"] = None
