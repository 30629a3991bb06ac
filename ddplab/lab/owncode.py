"""Code that brings its own process group, run on the lab's ranks: ``lab.spawn`` and ``lab.run_script``.

Programs found in tutorials start their own group. The DDP tutorial's
``demo_basic(rank, world_size)`` is started by ``torch.multiprocessing.spawn``
and calls ``setup()`` (``init_process_group``) and ``cleanup()``
(``destroy_process_group``) itself; a script written for torchrun reads
``RANK``, ``WORLD_SIZE``, ... and calls ``init_process_group()``. Both run
unchanged on a lab's ranks:

- ``spawn(lab, fn, args)``: ``fn(rank, *args)`` on every rank, the results by
  rank (``torch.multiprocessing.spawn``'s contract, with the lab's ranks as
  the processes). ``MASTER_ADDR``/``MASTER_PORT`` name a free port on rank 0's
  host, for code that does not set its own.
- ``run_script(lab, path, argv)``: the file as ``__main__`` on every rank,
  with the environment torchrun gives a worker; the ranks meet at a store rank
  0 holds, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``).

On each rank, ``ddplab.rank.owngroup.set_aside`` puts the lab's group aside
while the code runs and brings it back afterwards, whether the code destroyed
its group, forgot to, or failed. Output comes back by rank as for ``lab.run``.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Callable

from ..env import check_timeout
from ..errors import ConfigError, DdplabError
from ..rank import engine, owngroup

if TYPE_CHECKING:
    from .lab import Lab

log = logging.getLogger(__name__)


def spawn(lab: "Lab", fn: Callable, args: tuple = (), timeout: float | None = None,
          nprocs: int | None = None, join: bool = True) -> list[Any]:
    """``fn(rank, *args)`` on every rank with the lab's group set aside; results by rank."""
    if not callable(fn):
        raise ConfigError(f"ddplab: lab.spawn needs a function to call as fn(rank, *args), but "
                          f"got {fn!r} ({type(fn).__name__}). Use lab.spawn(demo_basic, "
                          f"args=(world_size,)).")
    if not isinstance(args, tuple):
        raise ConfigError(f"ddplab: lab.spawn's args must be a tuple, as for "
                          f"torch.multiprocessing.spawn, but got {type(args).__name__} {args!r}. "
                          f"Write args=({args!r},) for one argument.")
    if nprocs is not None and nprocs != lab.world_size:
        raise ConfigError(f"ddplab: lab.spawn(nprocs={nprocs!r}) asks for {nprocs} processes, but "
                          f"this lab has world_size={lab.world_size} ranks, and they are the "
                          f"processes. Leave nprocs out, or start a lab with "
                          f"ddplab.start(world_size={nprocs}).")
    if not join:
        raise ConfigError("ddplab: lab.spawn(join=False) is not supported: lab.spawn waits for "
                          "the ranks and returns their results. Leave join out.")
    timeout = _timeout(lab, timeout)
    lab.ensure_usable()
    host = lab.hosts[0]["address"]
    port = lab.run(owngroup.free_port, host, ranks=[0], timeout=timeout)[0]
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(port)}
    run_id = uuid.uuid4().hex[:12]
    tasks = [lab.calls.call(rank, engine.call, owngroup.run_spawned, (fn, rank, args, env, run_id),
                            {}) for rank in lab.ranks]
    lab.calls.finish(tasks, timeout, grace=None)
    return [task.outcome["value"] for task in sorted(tasks, key=lambda t: t.rank)]


def run_script(lab: "Lab", path: str | os.PathLike, argv: tuple = (),
               timeout: float | None = None) -> None:
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
    timeout = _timeout(lab, timeout)
    lab.ensure_usable()
    host = lab.hosts[0]["address"]
    port = lab.run(owngroup.open_agent_store, host, lab.world_size, timeout,
                   ranks=[0], timeout=timeout)[0]
    envs = torchrun_env(lab, host, port)
    try:
        tasks = [lab.calls.call(rank, engine.call, owngroup.run_script, (path, args, envs[rank]),
                                {}) for rank in lab.ranks]
        lab.calls.finish(tasks, timeout, grace=None)
    finally:
        _close_store(lab)


def torchrun_env(lab: "Lab", host: str, port: int) -> dict[int, dict[str, str]]:
    """The variables torchrun's agent sets for each worker, by rank (one run, no restarts)."""
    run_id = uuid.uuid4().hex[:12]
    envs = {}
    for node in lab.hosts:
        for local_rank, rank in enumerate(node["ranks"]):
            envs[rank] = {
                "RANK": str(rank), "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(lab.world_size), "LOCAL_WORLD_SIZE": str(len(node["ranks"])),
                "GROUP_RANK": str(node["node_rank"]), "GROUP_WORLD_SIZE": str(len(lab.hosts)),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(lab.world_size),
                "ROLE_NAME": "default", "MASTER_ADDR": host, "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
    return envs


def _close_store(lab: "Lab") -> None:
    """End rank 0's store once every rank is done with it (a broken lab ends it on restart)."""
    if not lab.healthy:
        return
    try:
        lab.run(owngroup.close_agent_store, ranks=[0])
    except DdplabError:
        log.debug("closing rank 0's rendezvous store failed", exc_info=True)


def _timeout(lab: "Lab", timeout: float | None) -> float:
    return lab.spec.timeout if timeout is None else check_timeout(timeout)
