"""all_reduce built from send/recv: the reference solutions of notebook 06.

Each function sums ``tensor`` over every rank *in place*, like
``dist.all_reduce(tensor)``, and needs only point-to-point messages:

    naive_all_reduce_collectives(t)   # dist.reduce to rank 0, then dist.broadcast
    naive_all_reduce(t)               # the same with send/recv: rank 0 does all the work
    ring_all_reduce(t)                # reduce-scatter then all-gather around a ring
    recursive_doubling_all_reduce(t)  # log2(p) rounds of pairwise exchange

What each costs, for a tensor of m bytes on p ranks, with α the latency of one
message and β the time per byte (the "α-β model"):

    naive:               2(p-1)(α + m β)   all of it through rank 0
    ring:                2(p-1)(α + (m/p) β)   every link busy, chunks of m/p
    recursive doubling:  log2(p) (α + m β)    few messages, whole tensor each time

So the ring moves the fewest bytes per rank, 2(p-1)/p m, which is why NCCL and
gloo use it for large tensors, and recursive doubling sends the fewest
messages, which wins for small ones. ``ddplab.bench`` measures all of them.

All of them work for any length (not only multiples of world_size), any shape,
any dtype torch can add, and world_size 1. They run on a rank: call them
through ``lab.run`` or from a ``%%ranks`` cell.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError

__all__ = [
    "ALL_REDUCE",
    "naive_all_reduce",
    "naive_all_reduce_collectives",
    "recursive_doubling_all_reduce",
    "ring_all_reduce",
    "ring_picture",
    "trace_ring",
    "tree_all_reduce",
]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``tensor`` (send/recv need contiguous memory; views share it)."""
    if not tensor.is_contiguous():
        raise ConfigError("ddplab: all_reduce from send/recv needs a contiguous tensor, as dist.all_reduce "
                         "does for gloo; pass tensor.contiguous() and copy the result back.")
    return tensor.view(-1)


def naive_all_reduce_collectives(tensor: torch.Tensor) -> torch.Tensor:
    """Sum to rank 0 with ``dist.reduce``, then send the sum to all with ``dist.broadcast``."""
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)   # only rank 0's tensor holds the sum
    dist.broadcast(tensor, src=0)                        # everyone's tensor becomes rank 0's
    return tensor


def naive_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Reduce then broadcast with send/recv only: every byte goes through rank 0."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        inbox = torch.empty_like(tensor)
        for src in range(1, world_size):     # in rank order, so the sum is the same every run
            dist.recv(inbox, src=src)
            tensor += inbox
        # isend to everyone at once: the sends overlap instead of queueing.
        requests = [dist.isend(tensor, dst=dst) for dst in range(1, world_size)]
        for request in requests:
            request.wait()
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)             # the sum overwrites our contribution
    return tensor


def ring_all_reduce(tensor: torch.Tensor, trace: list | None = None) -> torch.Tensor:
    """Ring all_reduce: p-1 reduce-scatter steps, then p-1 all-gather steps.

    The tensor is cut into p chunks (``tensor_split``: lengths differ by at
    most one, some are empty when the tensor is shorter than p). Every rank
    sends to rank+1 and receives from rank-1, one chunk per step.

    - reduce-scatter, step s = 0..p-2: send chunk (rank - s) % p, receive
      chunk (rank - s - 1) % p and add it to ours. Afterwards rank r holds
      the full sum of chunk (r + 1) % p.
    - all-gather, step s = 0..p-2: send chunk (rank + 1 - s) % p, the one we
      finished last, receive chunk (rank - s) % p and keep it as it is.

    With ``trace`` (a list), appends one dict per step: what this rank sent
    and received, and its whole buffer afterwards. ``ring_picture`` draws it.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = _flat(tensor)
    chunks = flat.tensor_split(world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if trace is not None:
        trace.append(dict(phase="start", step=0, rank=rank, sent=None, to=None,
                          received=None, source=None, buffer=flat.tolist()))
    # One receive buffer for the whole reduce-scatter: we must not receive
    # into our own chunk, which still holds our contribution.
    inbox = torch.empty_like(chunks[0])
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world_size - 1):
            offset = step if phase == "reduce-scatter" else step - 1
            send, recv = (rank - offset) % world_size, (rank - offset - 1) % world_size
            reduce = phase == "reduce-scatter"
            target = inbox[:chunks[recv].numel()] if reduce else chunks[recv]
            # Post the receive, then the send, then wait: every rank sends and
            # receives at once (a blocking send first would wait for a recv that
            # the neighbour posts only after its own send: a deadlock), and the
            # data has a place to land as soon as it arrives. Measured on gloo,
            # irecv-then-isend is faster than isend-then-recv.
            receiving = dist.irecv(target, src=left)
            sending = dist.isend(chunks[send], dst=right)
            receiving.wait()
            if reduce:
                chunks[recv].add_(target)        # another chunk than the one being sent
            sending.wait()
            if trace is not None:
                trace.append(dict(phase=phase, step=step + 1, rank=rank, sent=send, to=right,
                                  received=recv, source=left, buffer=flat.tolist()))
    return tensor


def recursive_doubling_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Recursive doubling: in round k, exchange the whole tensor with rank XOR 2**k and add.

    After log2(p) rounds every rank holds the sum. For a p that is not a
    power of two, the ranks beyond the largest power of two q first hand
    their tensor to rank - q, wait while the first q ranks run the rounds,
    then receive the result back.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = _flat(tensor)
    q = 1 << (world_size.bit_length() - 1)          # largest power of two <= world_size
    if rank >= q:                                     # an extra rank: fold in, wait, receive
        dist.send(flat, dst=rank - q)
        dist.recv(flat, src=rank - q)
        return tensor
    inbox = torch.empty_like(flat)
    if rank + q < world_size:
        dist.recv(inbox, src=rank + q)
        flat += inbox
    mask = 1
    while mask < q:
        partner = rank ^ mask
        request = dist.isend(flat, dst=partner)
        dist.recv(inbox, src=partner)
        request.wait()                   # flat is being sent: change it only afterwards
        flat += inbox                    # a + b == b + a exactly, so all ranks agree bit for bit
        mask <<= 1
    if rank + q < world_size:
        dist.send(flat, dst=rank + q)
    return tensor


def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """A binomial tree: reduce the whole tensor up to rank 0, then broadcast it down again.

    In round k of the reduce, a rank whose bit k is set sends its partial sum
    to rank - 2**k and is done; a rank below it adds what rank + 2**k sends.
    Rank 0 ends with the sum after ceil(log2 p) rounds. The broadcast walks
    the same tree backwards: each rank receives from its parent (its rank with
    the lowest set bit cleared), then sends to its children, farthest first.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = _flat(tensor)
    inbox = torch.empty_like(flat)
    mask = 1
    while mask < world_size:                          # up: partial sums move toward rank 0
        if rank & mask:
            dist.send(flat, dst=rank - mask)
            break
        if rank + mask < world_size:
            dist.recv(inbox, src=rank + mask)
            flat += inbox
        mask <<= 1
    lowest = rank & -rank                             # 0 for rank 0, the root
    if rank:
        dist.recv(flat, src=rank - lowest)            # down: the sum, from the parent
    mask = (lowest or 1 << (world_size - 1).bit_length()) >> 1
    while mask:
        if rank + mask < world_size:
            dist.send(flat, dst=rank + mask)
        mask >>= 1
    return tensor


#: The send/recv implementations by the name the benchmark uses.
ALL_REDUCE = {
    "naive": naive_all_reduce,
    "ring": ring_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
}


# --------------------------------------------------------------- the ring, drawn
def trace_ring(length: int) -> list[dict]:
    """On a rank: run ``ring_all_reduce`` on ``length`` elements worth 10**rank; return its trace.

    10**rank makes a partial sum readable: 1100 means ranks 2 and 3 are in it.
    """
    rank = dist.get_rank()
    tensor = torch.full((length,), 10 ** rank, dtype=torch.int64)
    trace: list[dict] = []
    ring_all_reduce(tensor, trace=trace)
    return trace


def ring_picture(traces: list[list[dict]]) -> Any:
    """Draw the traces of every rank (``lab.run(trace_ring, n)``) as one grid per step.

    Each grid shows every rank's buffer after that step, with bars between
    chunks, and what the rank sent and received in that step.
    """
    from .show import Grid, Picture, Row

    world_size = len(traces)
    grids = []
    for index, first in enumerate(traces[0]):
        rows = {}
        for rank, trace in enumerate(traces):
            entry = trace[index]
            length = len(entry["buffer"])
            bounds = [chunk.numel() for chunk in torch.arange(length).tensor_split(world_size)]
            breaks = tuple(sum(bounds[:i]) for i in range(1, world_size) if 0 < sum(bounds[:i]) < length)
            if entry["phase"] == "start":
                note = "its own contribution"
            else:
                verb = "added" if entry["phase"] == "reduce-scatter" else "copied"
                note = (f"sent chunk {entry['sent']} to rank {entry['to']}, {verb} chunk "
                        f"{entry['received']} from rank {entry['source']}")
            rows[rank] = Row(tuple(entry["buffer"]), note, breaks)
        title = ("before: rank r holds 10**r everywhere" if first["phase"] == "start"
                 else f"{first['phase']}, step {first['step']} of {world_size - 1}")
        grids.append(Grid(title, rows))
    return Picture(grids)
