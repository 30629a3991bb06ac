"""Where each rank runs: hosts, node rank, local rank and global rank.

A job on several machines numbers its processes three ways (torchrun's words):

- **node rank** (``GROUP_RANK``): which host, ``0 .. nnodes-1``;
- **local rank** (``LOCAL_RANK``): which process on that host, ``0 .. nproc_per_node-1``;
  it picks the GPU, so it restarts at 0 on every host;
- **global rank** (``RANK``): which process in the whole job,
  ``node_rank * nproc_per_node + local_rank`` when every host runs as many.

ddplab orders ranks by host, then by local rank, so ranks on one host are
neighbours, exactly as torchrun numbers them::

    >>> [(p.node_rank, p.local_rank, p.rank) for p in rank_table(2, 2)]
    [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]

Nothing here starts a process. ``describe_engine`` is the one function that
runs on an engine: it reports the address its host is reached at, so the
kernel can place ranks without trusting hostnames (two network namespaces on
one machine share a hostname, two hosts never share an address).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass

from .env import worker_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Engine:
    """What one engine told us about itself."""
    engine_id: int        # ipyparallel's id, never shown to students
    address: str          # the IPv4 address its host is reached at
    hostname: str
    ifname: str           # the network interface that carries ``address``
    pid: int              # on its own host
    gpus: int             # CUDA devices it can see
    tmpdir: str           # a private directory on its host (stack dumps)


@dataclass(frozen=True)
class Placement:
    """Where one torch rank runs."""
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    world_size: int
    host: str = ""        # the host's address ("" in a rank_table example)
    engine_id: int = -1


def rank_table(nnodes: int, nproc_per_node: int) -> list[Placement]:
    """The ranks of ``nnodes`` hosts with ``nproc_per_node`` processes each, as torchrun numbers them."""
    return [Placement(node * nproc_per_node + local, local, nproc_per_node, node, nnodes,
                      nnodes * nproc_per_node)
            for node in range(nnodes) for local in range(nproc_per_node)]


def _address_key(address: str) -> tuple:
    try:
        return (0, int(ipaddress.ip_address(address)))
    except ValueError:
        return (1, address)


def place(engines: list[Engine], host_order: list[str] = ()) -> list[Placement]:
    """Give every engine a rank: hosts in ``host_order`` (then by address), engines by id.

    Returns the placements indexed by rank. ``host_order`` holds addresses;
    hosts it does not name come after it, sorted numerically, so the order is
    the same however the engines happened to register.
    """
    by_host: dict[str, list[Engine]] = {}
    for e in engines:
        by_host.setdefault(e.address, []).append(e)
    named = [h for h in dict.fromkeys(host_order) if h in by_host]
    hosts = named + sorted((h for h in by_host if h not in named), key=_address_key)
    placements = []
    for node, host in enumerate(hosts):
        local = sorted(by_host[host], key=lambda e: e.engine_id)
        for local_rank, e in enumerate(local):
            placements.append(Placement(len(placements), local_rank, len(local), node,
                                        len(hosts), len(engines), host, e.engine_id))
    return placements


def rank_env(p: Placement, master_addr: str, master_port: int, ifname: str) -> dict[str, str]:
    """torchrun's variables for one placed rank, plus the interface gloo must use.

    Across hosts gloo has to pick the interface that carries the hosts'
    addresses; left to itself it picks whatever the hostname resolves to,
    which can be loopback or a network the other hosts cannot reach.
    """
    env = worker_env(p.rank, p.world_size, master_addr, master_port, local_rank=p.local_rank,
                     local_world_size=p.local_world_size, node_rank=p.node_rank, nnodes=p.nnodes)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = ifname
    return env


def local_address(peer: str) -> str:
    """The address this host uses to reach ``peer``: the one ``peer`` sees us at.

    Connecting a UDP socket sends nothing; it only asks the kernel's routing
    table which source address it would use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds ``address`` ("" if none does)."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return ""


def describe_engine(controller_ip: str) -> dict:
    """On an engine: its host's address as the controller sees it, and what it has."""
    import os
    import tempfile
    address = local_address(controller_ip)
    gpus = 0
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:            # a broken CUDA install: this host then counts as CPU-only
        log.debug("could not count this host's GPUs", exc_info=True)
    return {"address": address, "hostname": socket.gethostname(), "ifname": interface_of(address),
            "pid": os.getpid(), "gpus": gpus, "tmpdir": tempfile.mkdtemp(prefix="ddplab-rank-")}
