"""torch.distributed.rpc's state on a rank, ended after code that used RPC, as its process ending would.

``lab.spawn`` and ``lab.run_script`` run code written for a process of its
own on a rank that lives on (``owngroup.set_aside``). A program that calls
``rpc.init_rpc`` leaves state in torch's Python modules that a fresh process
would not have, and a second run on the same ranks trips over it:

- the **agent** (``api._get_current_rpc_agent``), if the code did not call
  ``rpc.shutdown()``: the next ``init_rpc`` fails with "RPC is already
  initialized";
- ``rpc._init_counter``, which names the keys each ``init_rpc`` meets under
  (``rpc_prefix_<n>``): a rank whose earlier run failed before its
  ``init_rpc`` counts one fewer than the others, and they meet under
  different keys, waiting for each other for ever;
- ``rpc.rendezvous_iterator`` (it keeps the last run's store alive) and the
  bookkeeping of ``rpc.shutdown``'s all-gather (``api._all_gather_sequence_id``,
  ``api._ALL_WORKER_NAMES``), whose counts would likewise drift apart.

And the run's ranks must meet where the lab's run meets: ``init_rpc`` does its
own rendezvous (``dist.rendezvous``), where rank 0 would serve a store at
MASTER_PORT, the port rank 0 already holds the run's store on ("address
already in use"). ``meeting_at`` sends an ``env://`` or ``tcp://`` rendezvous
there, as a client on every rank, as ``owngroup`` does for ``init_process_group``.

``end()`` shuts a forgotten agent down as ``rpc.shutdown()`` would (every
rank reaches ``end()`` after its code; if a peer is gone, locally) and says so,
and puts the rest back as a fresh process has it. Nothing here imports RPC: code that never used it
costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

log = logging.getLogger(__name__)

_RPC = "torch.distributed.rpc"
#: How long ``end()`` waits for the other ranks' agents in a graceful shutdown.
SHUTDOWN_S = 30
_ended = [0]                  # the init_rpc calls counted before the last ``end()`` reset them


def inits() -> int:
    """How many times ``rpc.init_rpc`` has been called on this rank (``rank.script`` asks)."""
    rpc = sys.modules.get(_RPC)
    return _ended[0] + int(getattr(rpc, "_init_counter", 0) or 0)


def end() -> None:
    """Shut down an RPC agent the code left running and reset RPC's counters (see the module)."""
    rpc = sys.modules.get(_RPC)
    api = sys.modules.get(_RPC + ".api")
    if rpc is None or api is None:
        return                                       # RPC never imported: nothing to end
    if api._is_current_rpc_agent_set():
        print("ddplab: the code left RPC running on this rank (no rpc.shutdown() after "
              "rpc.init_rpc); ddplab shut it down, as the end of a process of its own would. "
              "End RPC code with rpc.shutdown() on every rank: it waits for the other ranks' "
              "calls to finish.", file=sys.stderr, flush=True)
        _shut_down(rpc, api)
    with rpc._init_counter_lock:
        _ended[0] += rpc._init_counter
        rpc._init_counter = 0
    if hasattr(rpc, "rendezvous_iterator"):
        rpc.rendezvous_iterator = None               # releases the last run's store
    with api._all_gather_dict_lock:
        api._all_gather_sequence_id.clear()
        api._all_gather_sequence_id_to_states.clear()
    api._ALL_WORKER_NAMES = set()


def _shut_down(rpc, api) -> None:
    """As ``rpc.shutdown()`` would (every rank reaches it after its code); locally if that fails."""
    try:
        rpc.shutdown(graceful=True, timeout=SHUTDOWN_S)
        return
    except Exception:                                 # a peer gone or failed: end this one alone
        log.debug("a graceful RPC shutdown failed", exc_info=True)
    try:
        if api._is_current_rpc_agent_set():
            rpc.shutdown(graceful=False)
    except Exception:
        log.debug("a local RPC shutdown failed", exc_info=True)
        api._reset_current_rpc_agent()


@contextlib.contextmanager
def meeting_at(meet: tuple[str, int] | None, timeout_s: float = 300) -> Iterator[None]:
    """While open, ``dist.rendezvous`` by address (what ``init_rpc`` calls) meets at ``meet``."""
    import torch.distributed as dist
    real = dist.rendezvous
    if meet is None:
        yield
        return

    def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs):
        if not url.startswith(("env://", "tcp://")):
            yield from real(url, rank, world_size, **kwargs)
            return
        import datetime
        import os
        rank = rank if rank >= 0 else int(os.environ["RANK"])
        world_size = world_size if world_size >= 0 else int(os.environ["WORLD_SIZE"])
        timeout = kwargs.get("timeout") or datetime.timedelta(seconds=timeout_s)
        yield dist.TCPStore(meet[0], meet[1], world_size, is_master=False, timeout=timeout), \
            rank, world_size

    dist.rendezvous = rendezvous
    try:
        yield
    finally:
        dist.rendezvous = real
