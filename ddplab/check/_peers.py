"""On a rank: the point-to-point calls a check watches (send, recv, isend, irecv), and their peers.

Checks that follow a student's messages (notebook 01's buffers, 06's ring,
14's ring attention and experts) swap torch's four calls for their own
wrappers while the student's code runs, through ``swap_peer_calls``.
"""

from __future__ import annotations

from typing import Any, Callable

#: The point-to-point calls the checkers watch, and the keyword naming the other rank.
PEER_KEYWORD = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


def peer(args: tuple, kwargs: dict, keyword: str) -> Any:
    """The other rank of a send or recv call, as a global rank.

    ``dst=``/``src=`` or the second argument; or ``group_dst=``/``group_src=``,
    a rank within ``group=``, which is how ``batch_isend_irecv`` calls each op.
    """
    if keyword in kwargs:
        return kwargs[keyword]
    if len(args) > 1:
        return args[1]
    group_peer, group = kwargs.get("group_" + keyword), kwargs.get("group")
    if group_peer is None or group is None:
        return group_peer
    import torch.distributed as dist
    return dist.get_global_rank(group, group_peer)


def swap_peer_calls(wrap: Callable) -> Callable[[], None]:
    """Replace send/recv/isend/irecv by ``wrap(name, keyword, real)``; returns the undo.

    One replacement per name, set in both ``torch.distributed`` and
    ``distributed_c10d``: ``P2POp`` accepts an op only if it *is*
    ``distributed_c10d.isend`` or ``irecv``, so a student's
    ``P2POp(dist.isend, ...)`` must find the very same object there.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = {(module, name): getattr(module, name) for module in (dist, c10d) for name in PEER_KEYWORD}
    for name, keyword in PEER_KEYWORD.items():
        replacement = wrap(name, keyword, saved[(dist, name)])
        for module in (dist, c10d):
            setattr(module, name, replacement)

    def undo() -> None:
        for (module, name), value in saved.items():
            setattr(module, name, value)
    return undo
