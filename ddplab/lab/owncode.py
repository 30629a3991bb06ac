"""Code that brings its own process group, run on the lab's ranks: ``lab.spawn`` and ``lab.run_script``.

Programs found in tutorials start their own group. The DDP tutorial's
``demo_basic(rank, world_size)`` is started by ``torch.multiprocessing.spawn``
and calls ``setup()`` (``init_process_group``) and ``cleanup()``
(``destroy_process_group``) itself; a script written for torchrun reads
``RANK``, ``WORLD_SIZE``, ... and calls ``init_process_group()``. Both run
unchanged on a lab's ranks:

- ``spawn(calls, fn, args)``: ``fn(rank, *args)`` on every rank, the results by
  rank (``torch.multiprocessing.spawn``'s contract, with the lab's ranks as
  the processes). ``MASTER_ADDR``/``MASTER_PORT`` name the run's store, for
  code that does not set its own; code that does meets there all the same.
- ``run_script(calls, path, argv)``: the file as ``__main__`` on every rank,
  with the environment torchrun gives a worker.

Both take the lab's ``Calls`` (what they send, and its ``engines``: the world
size and the hosts), never the ``Lab``; ``Lab.spawn`` and ``Lab.run_script``
pass it with the timeout resolved.

Both run jobs, so their ``timeout`` is a no-progress timeout (``ddplab.lab.stall``):
a training run that computes, or whose collectives move, runs on past it; the
job ends with a ``HangError`` only once no rank made progress for a whole
timeout, and that error's first line says whether every rank waited in
communication. ``limit=`` (seconds) caps the whole run, if given.

Either way the ranks meet at a fresh store rank 0 holds for the run, as
torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``), whatever port the
code names (``ddplab.rank.owngroup`` says why).

On each rank, ``ddplab.rank.owngroup.set_aside`` puts the lab's group aside
while the code runs and brings it back afterwards, whether the code destroyed
its group, forgot to, or failed. Output comes back by rank as for ``lab.run``.
Both send their code as every job does (``ddplab.lab.shipping``): the user's
modules by name, freshly loaded on each rank before the run starts.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable

from ..env import worker_env
from ..errors import ConfigError, DdplabError
from ..rank import engine, owngroup, script
from ..text import plural
from . import shipping
from .calls import Calls
from .stall import Watch

log = logging.getLogger(__name__)


def sources(fn: Callable) -> dict[str, list[str]]:
    """The source lines of ``fn``'s file when only this kernel has them (a notebook cell).

    A function defined in a cell names a file that exists only in the
    kernel's ``linecache`` (``/tmp/ipykernel_.../123.py``): on a rank, pdb's
    ``l`` would show ``[EOF]`` and tracebacks no lines. Sent along with the
    call, the rank registers them (``engine.call``). Files on disk are read
    there as here.
    """
    import linecache

    code = getattr(fn, "__code__", None)
    filename = getattr(code, "co_filename", "")
    if not filename or os.path.exists(filename):
        return {}
    lines = linecache.getlines(filename)
    return {filename: lines} if lines else {}


def spawn(calls: Calls, fn: Callable, args: tuple, timeout: float,
          nprocs: int | None = None, join: bool = True, limit: float | None = None) -> list[Any]:
    """``fn(rank, *args)`` on every rank with the lab's group set aside; results by rank."""
    if not callable(fn):
        raise ConfigError(f"ddplab: lab.spawn needs a function to call as fn(rank, *args), but "
                          f"got {fn!r} ({type(fn).__name__}). Use lab.spawn(demo_basic, "
                          f"args=(world_size,)).")
    if not isinstance(args, tuple):
        raise ConfigError(f"ddplab: lab.spawn's args must be a tuple, as for "
                          f"torch.multiprocessing.spawn, but got {type(args).__name__} {args!r}. "
                          f"Write args=({args!r},) for one argument.")
    world_size = calls.engines.world_size
    if nprocs is not None and nprocs != world_size:
        raise ConfigError(f"ddplab: lab.spawn(nprocs={nprocs!r}) asks for {nprocs} processes, but "
                          f"this lab has {world_size} {plural(world_size, 'rank')} "
                          f"(world_size={world_size}), and they are the processes. Leave nprocs "
                          f"out, or start a lab with ddplab.start(world_size={nprocs}).")
    if not join:
        raise ConfigError("ddplab: lab.spawn(join=False) is not supported: lab.spawn waits for "
                          "the ranks and returns their results. Leave join out.")
    calls.ensure_usable()
    pickled = shipping.pack("lab.spawn", owngroup.run_spawned, (fn, args), named=fn)
    host, port = _open_store(calls, timeout)
    run_id, path, lines = uuid.uuid4().hex[:12], shipping.kernel_path(), sources(fn)
    try:
        tasks = [calls.call(rank, engine.call_pickled, pickled,
                            (rank, {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(rank),
                                    "WORLD_SIZE": str(world_size)}, run_id), lines, path)
                 for rank in range(world_size)]
        calls.finish(tasks, timeout, grace=None, watch=Watch(calls.engines, job=True, limit=limit))
    finally:
        _close_store(calls, timeout)
    return [task.outcome["value"] for task in sorted(tasks, key=lambda t: t.rank)]


def run_script(calls: Calls, path: str | os.PathLike, argv: tuple, timeout: float,
               limit: float | None = None) -> None:
    """Run ``path`` as ``__main__`` on every rank, as under torchrun; see the module docstring."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"ddplab: lab.run_script needs the path of a Python file, but got "
                          f"{path!r} ({type(path).__name__}). Use lab.run_script('train.py', "
                          f"'--epochs', '2').")
    path = os.path.abspath(os.fspath(path))      # the ranks' working folder may differ
    if not os.path.isfile(path):
        raise ConfigError(f"ddplab: lab.run_script found no file at {path!r}. Expected the path "
                          f"of a Python script (relative to the notebook's folder, "
                          f"{os.getcwd()!r}, or absolute).")
    args = [str(a) for a in argv]
    calls.ensure_usable()
    host, port = _open_store(calls, timeout)
    envs = torchrun_env(calls.engines.hosts, calls.engines.world_size, host, port)
    pickled, kernel_path = shipping.pack("lab.run_script", script.run_script, (path, args)), \
        shipping.kernel_path()
    try:
        tasks = [calls.call(rank, engine.call_pickled, pickled, (envs[rank],), {}, kernel_path)
                 for rank in range(calls.engines.world_size)]
        calls.finish(tasks, timeout, grace=None, watch=Watch(calls.engines, job=True, limit=limit))
    finally:
        _close_store(calls, timeout)


def torchrun_env(hosts: list[dict], world_size: int, host: str,
                 port: int) -> dict[int, dict[str, str]]:
    """The variables torchrun's agent sets for each worker, by rank (one run, no restarts).

    ``hosts``: one entry per host, as ``lab.hosts`` lists them (``node_rank``, ``ranks``).
    """
    run_id = uuid.uuid4().hex[:12]
    envs = {}
    for node in hosts:
        for local_rank, rank in enumerate(node["ranks"]):
            envs[rank] = {
                **worker_env(rank, world_size, host, port, local_rank=local_rank,
                             local_world_size=len(node["ranks"]), node_rank=node["node_rank"],
                             nnodes=len(hosts)),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
                "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
    return envs


def _on_rank_0(calls: Calls, timeout: float, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` on rank 0, waited for as ``lab.run`` waits; its value."""
    task = calls.call(0, engine.call, fn, args, {})
    calls.finish([task], timeout, grace=None)
    return task.outcome["value"]


def _open_store(calls: Calls, timeout: float) -> tuple[str, int]:
    """Rank 0 holds a fresh store for the run (as torchrun's agent does): its address and port."""
    host = calls.engines.hosts[0]["address"]
    return host, _on_rank_0(calls, timeout, owngroup.open_agent_store, host,
                            calls.engines.world_size, timeout)


def _close_store(calls: Calls, timeout: float) -> None:
    """End rank 0's store once every rank is done with it (a broken lab ends it on restart)."""
    if not calls.engines.running or calls.broken_reason():
        return
    try:
        _on_rank_0(calls, timeout, owngroup.close_agent_store)
    except DdplabError:
        log.debug("closing rank 0's rendezvous store failed", exc_info=True)
