"""ipyparallel's controller on Unix sockets: ``python -m ddplab.rank.ipc_controller ARGS``.

A local lab's controller listens on no port: with
``--IPController.transport=ipc --IPController.ip=LABDIR/c`` every channel is a
Unix socket in the lab's private (0700) directory, which no other user can
open, and which the engines reach from inside the lab's own network
(``ddplab.rank.netns``), where 127.0.0.1 is not the kernel's.

One fix is needed first. ipyparallel 9.2's controller binds an ipc channel at
``PATH-PORT`` while its clients and engines connect to ``PATH:PORT`` (the
controller's ``construct_url`` joins ipc addresses with ``-``, the client's and
the engine's always with ``:``), so, out of the box, nothing ever connects. In
this process only, the controller binds where the others look. If a later
ipyparallel joins them alike, the fix finds nothing to change.
"""

from __future__ import annotations

from ipyparallel.controller.app import IPController, main

_construct_url = IPController.construct_url


def _construct_url_as_clients_do(self: IPController, kind: str, channel: str,
                                 index: int | None = None) -> str:
    url = _construct_url(self, kind, channel, index)
    info = {"engine": self.engine_info, "client": self.client_info}.get(kind) or self.internal_info
    interface = info["interface"]
    if interface.startswith("ipc://") and url.startswith(interface + "-"):
        return f"{interface}:{url[len(interface) + 1:]}"
    return url


IPController.construct_url = _construct_url_as_clients_do

if __name__ == "__main__":
    main()
