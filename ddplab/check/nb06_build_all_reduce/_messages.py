"""The messages a send/recv all_reduce makes, followed on every rank (notebook 06's method checks).

``message_log`` runs on a rank; ``ring_problems`` and ``tree_depth`` read the logs
of all ranks, for ``ring_all_reduce`` and ``tree_all_reduce`` in ``methods``.
A count that is off says how many were made, how many a ring makes, and which way.
"""

from __future__ import annotations

from typing import Any, Callable

from .._forbid import forbidding
from .._peers import peer, swap_peer_calls
from ._reference import refusing_reference

__all__ = ["message_log", "ring_problems", "tree_depth"]


def message_log(fn: Callable, exercise: str, length: int,
                forbidden: tuple[str, ...]) -> list[tuple[str, Any, int]]:
    """On a rank: the sends and receives ``fn`` makes for one tensor of ``length`` elements.

    Each as ("send" | "recv", peer, elements sent or received).
    """
    import torch
    import torch.distributed as dist

    log: list[tuple[str, Any, int]] = []
    nesting = [0]            # torch's send may call its own isend: count the outermost call only

    def logged(name, keyword, real):
        def call(*args, **kwargs):
            if not nesting[0]:
                tensor = args[0] if args else kwargs.get("tensor")
                log.append(("send" if "send" in name else "recv", peer(args, kwargs, keyword),
                            int(getattr(tensor, "numel", lambda: -1)())))
            nesting[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                nesting[0] -= 1
        return call

    undo = swap_peer_calls(logged)
    try:
        with forbidding(forbidden, exercise), refusing_reference(exercise):
            fn(torch.randn(length, generator=torch.Generator().manual_seed(dist.get_rank())))
    finally:
        undo()
    dist.barrier()
    return log


def tree_depth(parents: dict[int, Any]) -> int | None:
    """Levels below rank 0 of the tree ``parents`` draws (rank -> parent); None if it is no tree."""
    deepest = 0
    for rank in parents:
        level, seen = 0, set()
        while rank != 0:
            if rank in seen or rank not in parents:
                return None
            seen.add(rank)
            rank, level = parents[rank], level + 1
        deepest = max(deepest, level)
    return deepest


def ring_problems(logs: list[list[tuple[str, Any, int]]], length: int) -> list[str]:
    """What in the ranks' message logs a ring all_reduce of ``length`` elements would not do."""
    p = len(logs)
    chunk = length // p
    if p > 1 and not any(logs):
        return ["no send or receive could be seen: call dist.isend / dist.irecv (or send / recv) "
                "through `dist.` (import torch.distributed as dist), so the check can follow them"]
    problems = []
    for rank, log in enumerate(logs):
        right, left = (rank + 1) % p, (rank - 1) % p
        for op, other in (("send", right), ("recv", left)):
            mine = [(who, size) for kind, who, size in log if kind == op]
            elsewhere = sorted({who for who, _ in mine if who != other}, key=str)
            if elsewhere:
                verb, to = ("sent to", "right") if op == "send" else ("received from", "left")
                problems.append(f"rank {rank} {verb} rank {', '.join(map(str, elsewhere))}; a ring "
                                f"only {'sends to' if op == 'send' else 'receives from'} its {to} "
                                f"neighbour, rank {other}")
            if len(mine) != 2 * (p - 1):
                off = len(mine) - 2 * (p - 1)
                problems.append(f"rank {rank} made {len(mine)} {op}(s), {abs(off)} "
                                f"{'more' if off > 0 else 'fewer'} than a ring's 2(p-1) = "
                                f"{2 * (p - 1)}")
            sizes = sorted({size for _, size in mine if size != chunk})
            if sizes:
                problems.append(f"rank {rank} {'sent' if op == 'send' else 'received'} messages of "
                                f"{', '.join(map(str, sizes))} elements; a ring moves chunks of "
                                f"1/p of the tensor ({chunk} of {length})")
    return problems
