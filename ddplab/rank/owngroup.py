"""Code that makes its own process group, run on a rank that already has the lab's.

A rank of a lab is in a process group from the start: ``ddplab.start`` called
``init_process_group`` for it. Code a learner brings (the DDP tutorial's
``demo_basic(rank, world_size)``, a script written for torchrun) calls
``init_process_group`` itself and ends with ``destroy_process_group()``. torch
keeps one default group per process, so on a lab's rank the first call fails
("trying to initialize the default process group twice!") and the second one
silently removes the lab's group.

This module lets such code run unchanged, and explains what happens otherwise:

- ``set_aside()``: while it is open, the lab's groups are put aside (kept
  alive, not shut down) and torch.distributed looks uninitialised; the code
  inside calls ``init_process_group`` and ``destroy_process_group`` as in a
  process of its own. On the way out, whatever group the code left behind is
  destroyed and the lab's groups are the default again. ``run_spawned`` (for
  ``lab.spawn``) and ``rank.script.run_script`` (for ``lab.run_script``) run user code in it.
- ``guard()``: once the lab's group exists, an ``init_process_group`` outside
  ``set_aside`` fails at once with a message naming the two ways to run such
  code, and after a ``destroy_process_group()`` of the lab's group, the error
  it leads to ("Default process group has not been initialized") says what
  happened and how to get the group back (``explain``).

torch keeps its group state in ``torch.distributed.distributed_c10d``: the
default group (``_world.default_pg``), per-group maps (``pg_map``,
``pg_names``, ...), a counter that names new groups, and a C++ registry of
groups by name (which functional collectives, DTensor and FSDP2 look groups up
in). Setting aside saves and clears all of them, without calling ``shutdown``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import logging
import os
import socket
import sys
import time
from typing import Any, Callable, Iterator

from ..errors import DdplabError
from . import recorder, rpcstate

log = logging.getLogger(__name__)

#: The ``_World`` maps torch keeps per group; all are saved and cleared together.
_MAPS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")
#: How long the GIL is released before code's own group ends (see ``_let_workers_drain``).
DRAIN_S = 0.1
_state: dict[str, Any] = {"lab_pg": None, "lab_destroyed": False, "aside": 0, "inits": 0,
                          "run_id": "", "run_inits": 0, "meet": None, "agent_store": None,
                          "real_init": None, "real_destroy": None}


class LabGroupError(DdplabError, ValueError):
    """A second ``init_process_group`` on a rank that is in the lab's group.

    A ``ValueError``, like torch's own "initialize the default process group twice".
    """


def _c10d():
    import torch.distributed.distributed_c10d as c10d
    return c10d


# ------------------------------------------------------------------ the guard
def guard() -> None:
    """Remember the lab's default group and put the two guards in place (once per process).

    Called by ``engine.join_group`` once the lab's group has formed.
    """
    _state["lab_pg"] = _c10d()._world.default_pg
    _install()


def _install() -> None:
    """Wrap ``init_process_group`` and ``destroy_process_group`` (once per process).

    Bare ranks (``start(init_method=None)``) get the wrappers from ``set_aside``:
    with no lab group to guard, they only count groups and give each its own keys.
    """
    import torch.distributed as dist
    c10d = _c10d()
    if _state["real_init"] is not None:
        return
    # init_process_group is torch's logging wrapper around the real function, held in
    # a closure cell: swapping the cell's contents keeps ``dist.init_process_group``
    # the same object, so even a name imported earlier goes through the guard
    # (``ddplab.rank.trace`` swaps the same cell, and finds the guard there).
    wrapper = dist.init_process_group
    cell = wrapper.__closure__[wrapper.__code__.co_freevars.index("func")]
    real_init = cell.cell_contents

    signature = inspect.signature(c10d.init_process_group)

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if _lab_group_is_default():
            raise LabGroupError(_twice_message())
        if _state["aside"]:
            bound = signature.bind(*args, **kwargs)
            _own_rendezvous(bound.arguments)
            args, kwargs = bound.args, bound.kwargs
        result = real_init(*args, **kwargs)
        _state["inits"] += 1
        return result

    cell.cell_contents = init_process_group
    _state["real_init"] = real_init
    # destroy_process_group has no such cell: swap the module attributes.
    real_destroy = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        lab_pg = _state["lab_pg"]
        ending_lab = lab_pg is not None and _lab_group_is_default() and group in (None, lab_pg)
        if _state["aside"]:
            _let_workers_drain()
        real_destroy(group)
        if ending_lab:
            _state["lab_pg"] = None
            _state["lab_destroyed"] = not _called_by_ddplab()

    destroy_process_group.__wrapped__ = real_destroy
    for module in (dist, c10d):
        module.destroy_process_group = destroy_process_group
    _state["real_destroy"] = real_destroy


def _own_rendezvous(arguments: dict[str, Any]) -> None:
    """Meet at the run's own store, under keys of this group only.

    ``init_process_group`` does a rendezvous itself; we do it first. Code that
    meets by address (``env://``, ``tcp://``) meets at the store rank 0 holds
    for this run (``open_agent_store``), whatever MASTER_PORT it names: every
    rank names the same one, so every rank is sent to the same place. A fixed
    port would not do on a long-lived rank: torch keeps the first group a DDP
    model used alive for the life of the process, and with it the TCPStore
    rank 0 served at that port. The next run would meet that old store (whose
    keys still describe the old group: it waits forever), and any other
    process, a launch or a second lab, would find the port taken. Code that
    meets in a file (``file://``) meets there.
    """
    backend = str(arguments.get("backend") or "").lower()
    if arguments.get("store") is not None or backend in ("mpi", "fake"):
        return
    c10d = _c10d()
    timeout = arguments.get("timeout") or c10d.default_pg_timeout
    method = arguments.get("init_method") or "env://"
    rank, world_size = arguments.get("rank", -1), arguments.get("world_size", -1)
    meet = _state["meet"]
    if meet is not None and method.startswith(("env://", "tcp://")):
        rank = rank if rank >= 0 else int(os.environ["RANK"])
        world_size = world_size if world_size >= 0 else int(os.environ["WORLD_SIZE"])
        import torch.distributed as dist
        store = dist.TCPStore(meet[0], meet[1], world_size, is_master=False, timeout=timeout)
    else:
        store, rank, world_size = next(c10d.rendezvous(method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    _state["run_inits"] += 1           # a second group in one run gets keys of its own
    prefix = f"ddplab/{_state['run_id']}/{_state['run_inits']}"
    arguments.update(init_method=None, rank=rank, world_size=world_size,
                     store=c10d.PrefixStore(prefix, store))


def _let_workers_drain() -> None:
    """Release the GIL for a moment before code's own group goes away.

    A gloo group ends its worker threads, holding the GIL, when its last
    reference goes (often a DDP model's reducer, freed as the student's function
    returns). A worker still dropping the last collective it ran may need the
    GIL to do so, and the two wait for each other forever. A process of its own
    exits instead; here the rank must live on. While we sleep, the workers
    finish what they hold, so the end finds them idle.
    """
    time.sleep(DRAIN_S)


def _lab_group_is_default() -> bool:
    lab_pg = _state["lab_pg"]
    return lab_pg is not None and _c10d()._world.default_pg is lab_pg


def _called_by_ddplab() -> bool:
    """Whether ddplab itself (leaving the group on a stop) destroys the lab's group.

    The nearest caller outside torch and ddplab's trace wrappers decides.
    """
    frame = sys._getframe(2)
    passing = ("torch.", "ddplab.rank.trace", "ddplab.rank.recorder", __name__)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(passing):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("ddplab.")


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _twice_message() -> str:
    return (f"ddplab: init_process_group was called on rank {_rank()}, but this rank is already "
            f"in the lab's process group (ddplab.start made it), and torch allows one default "
            f"group per process. Code that makes its own group runs unchanged through "
            f"lab.spawn(fn, args=(...)) (as torch.multiprocessing.spawn would call fn(rank, "
            f"*args)) or lab.run_script('train.py') (as torchrun would run it): they set the "
            f"lab's group aside while it runs. Or start ranks without a group, "
            f"ddplab.start(world_size=..., init_method=None), and call init_process_group in "
            f"%%ranks cells. In this cell, use the lab's group as it is: leave out "
            f"init_process_group and destroy_process_group.")


def explain(exc: BaseException) -> str:
    """For an error on a rank whose lab group the student destroyed: what happened, and the fix.

    Said with the error it causes, not when ``destroy_process_group()`` runs: that
    is also how a notebook's last cell cleans up, where there is nothing to fix.
    """
    if not _state.get("lab_destroyed") or "process group has not been initialized" not in str(exc):
        return ""
    return (f"\nddplab: an earlier destroy_process_group() removed the lab's process group on rank "
            f"{_rank()}, so this rank is in no group now. Get it back with lab.restart() (fresh "
            f"ranks, in the lab's group again). To run code that makes and destroys its own "
            f"group, use lab.spawn(fn, args=(...)) or lab.run_script('train.py'): they keep the "
            f"lab's group.")


# ------------------------------------------------------------------ setting aside
@contextlib.contextmanager
def set_aside(env: dict[str, str] | None = None, run_id: str = "") -> Iterator[None]:
    """Run the body as if this process had no process group; the lab's is back afterwards.

    ``env`` is set in ``os.environ`` for the body (the fresh rendezvous); ``run_id``,
    the same on every rank, prefixes the keys of the groups the body makes. Every
    variable the body changes, ``sys.argv``, ``sys.path`` and ``sys.excepthook``
    (each ``init_process_group`` wraps it) are put back as they were.
    """
    _install()
    c10d = _c10d()
    world = c10d._world
    recorder.settle_groups()           # a running trace looks up the lab's groups while it can
    saved = {name: dict(getattr(world, name)) for name in _MAPS}
    tags = {tag: list(groups) for tag, groups in world.tags_to_pg.items()}
    coalesce = dict(world.pg_coalesce_state)
    default, count = world.default_pg, world.group_count
    backend, init_method = c10d._backend, c10d._default_pg_init_method
    environ, argv, path, hook = dict(os.environ), list(sys.argv), list(sys.path), sys.excepthook
    for name in _MAPS:
        getattr(world, name).clear()
    world.tags_to_pg.clear()
    world.pg_coalesce_state.clear()
    c10d._update_default_pg(None)
    world.group_count = 0              # the body's first group is named "0", as in a process of its own
    c10d._unregister_all_process_groups()
    os.environ.update(env or {})
    _state["aside"] += 1
    _state["run_id"], _state["run_inits"] = run_id or str(os.getpid()), 0
    given = env or {}
    _state["meet"] = ((given["MASTER_ADDR"], int(given["MASTER_PORT"]))
                      if "MASTER_ADDR" in given and "MASTER_PORT" in given else None)
    try:
        with rpcstate.meeting_at(_state["meet"]):   # init_rpc meets at the run's store too
            yield
    finally:
        _state["aside"] -= 1
        try:
            recorder.settle_groups()       # and the code's own groups, before they end
            rpcstate.end()                 # an RPC agent the code left, and RPC's counters
            _end_own_groups()
        finally:
            for name in _MAPS:
                getattr(world, name).clear()
                getattr(world, name).update(saved[name])
            world.tags_to_pg.clear()
            world.tags_to_pg.update(tags)
            world.pg_coalesce_state.clear()
            world.pg_coalesce_state.update(coalesce)
            c10d._update_default_pg(default)
            world.group_count = count
            c10d._backend, c10d._default_pg_init_method = backend, init_method
            c10d._unregister_all_process_groups()
            for pg, name in saved["pg_names"].items():
                c10d._register_process_group(name, pg)
            for name in set(os.environ) - set(environ):
                del os.environ[name]
            os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
            sys.argv[:], sys.path[:], sys.excepthook = argv, path, hook


def _end_own_groups() -> None:
    """Destroy the groups the code left behind, as its process ending would have.

    Then collect garbage: a DDP model lives in reference cycles, and through its
    group it keeps rank 0's TCPStore listening. Code that names a fixed
    MASTER_PORT (the DDP tutorial's 12355) and runs again in this process would
    meet that old store, whose keys still describe the old group, and hang.
    """
    c10d = _c10d()
    if c10d._world.default_pg is None and not c10d._world.pg_map:
        gc.collect()
        return
    destroy = _state["real_destroy"] or c10d.destroy_process_group
    if c10d._world.default_pg is not None:
        _let_workers_drain()
        try:
            destroy(None)
        except Exception:               # a group broken by a failed rank: drop it anyway
            log.debug("ending the groups left behind failed", exc_info=True)
    c10d._unregister_all_process_groups()
    for name in _MAPS:
        getattr(c10d._world, name).clear()
    gc.collect()


def run_spawned(fn: Callable, args: tuple, rank: int, env: dict[str, str], run_id: str) -> Any:
    """``fn(rank, *args)`` with the lab's group set aside: one rank of ``lab.spawn``."""
    with set_aside(env, run_id):
        return fn(rank, *args)


def inits() -> int:
    """How many times this rank's code has called ``init_process_group`` (``rank.script`` asks)."""
    return _state["inits"]


def open_agent_store(host: str, world_size: int, timeout_s: float) -> int:
    """On rank 0: start the TCPStore the ranks of one ``lab.spawn`` / ``run_script`` meet at; its port.

    torchrun's agent holds this store and tells its workers so with
    ``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0 too, then connects
    to it as a client in ``init_process_group()``. Holding it here means the port
    is bound before any rank looks for it (nothing can take it in between).
    """
    import torch.distributed as dist
    close_agent_store()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))               # only on the lab's address, as engine.open_store
    listener.listen(128)
    port = listener.getsockname()[1]
    fd = listener.detach()                 # the store owns (and closes) the descriptor now
    try:
        store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    _state["agent_store"] = store
    return store.port


def close_agent_store() -> None:
    """On rank 0: end the store of the last ``run_script`` (if any)."""
    _state["agent_store"] = None
