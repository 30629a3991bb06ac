"""Step 3 of a plan: what a collective costs on a network, by the α-β model.

    net = Network.from_bench(ddplab.bench.fit_ring(results))   # your lab's fit
    net = Network.named("nvlink+ib")                           # or a named interconnect
    net.seconds("all_reduce", 100e6, 64)                       # ring: 2(N-1)α + 2(N-1)/N·bytes·β

The α-β model: sending m bytes costs α + m·β (α the latency of one message,
β seconds per byte). A ring all_reduce of S bytes on N ranks is 2(N-1) steps
of S/N bytes each, ``2(N-1)α + 2(N-1)/N·S·β``; a ring all_gather or
reduce_scatter (S the gathered size) is half of it, ``(N-1)α + (N-1)/N·S·β``.
A tree all_reduce (NCCL's double binary tree) takes ``2·log2(N)`` latency steps
and sends about ``2·S`` bytes per rank: slower on big tensors, faster at large
N for small ones. ``ddplab.bench.fit_ring`` fits the same ring formula, so a
fit from your lab plugs in unchanged.

A named interconnect has two links: ``intra`` inside a node of
``per_node`` GPUs (NVLink) and ``inter`` between nodes; a group that fits in a
node uses the first, any bigger group is as fast as its slowest link, the second.

``torch_guess`` is torch's own estimate of the same collective, from DTensor's
cost model (``torch/distributed/tensor/_collective_utils.py``: a ring, 87.7 GB/s
and 0.6 µs per hop inside a host, 22 % of that bandwidth and 2.7 µs between
hosts, plus 6.6 µs to launch), shown beside yours in the plan's table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["INTERCONNECTS", "Link", "Network", "torch_guess"]


@dataclass(frozen=True)
class Link:
    alpha: float                  # seconds per message
    beta: float                   # seconds per byte


@dataclass(frozen=True)
class Network:
    name: str
    intra: Link
    inter: Link
    per_node: int = 8
    algorithm: str = "ring"       # "ring" or "tree" (all_reduce only)

    @classmethod
    def from_bench(cls, fit: dict, name: str = "your lab's α-β fit") -> Network:
        """One link everywhere, from ``ddplab.bench.fit_ring`` (or ``machine``): {"alpha", "beta"},
        each a finite number >= 0 (refused otherwise, with the fix)."""
        from .inputs import alpha_beta

        link = Link(*alpha_beta(fit))
        return cls(name, link, link, per_node=1 << 30)

    @classmethod
    def named(cls, name: str) -> Network:
        if name not in INTERCONNECTS:
            raise ConfigError(f"ddplab.plan: no interconnect named {name!r}; use one of "
                              f"{', '.join(INTERCONNECTS)}, or Network.from_bench(fit) with your "
                              f"lab's ddplab.bench fit.")
        return INTERCONNECTS[name]

    def link(self, group: int) -> Link:
        return self.intra if group <= self.per_node else self.inter

    def seconds(self, op: str, nbytes: float, group: int, span: int | None = None) -> float:
        """One collective on ``group`` ranks; ``nbytes``: the tensor all_reduced, or the gathered
        (all_gather) / scattered (reduce_scatter) whole; p2p ``send``: the message. ``span``:
        how many consecutive ranks the group's members spread over (a data-parallel group
        strided by tp spans D*T), which decides its link; default ``group``."""
        n, link = group, self.link(span or group)
        if op == "send":
            return link.alpha + nbytes * link.beta
        if n <= 1:
            return 0.0
        if op == "all_reduce":
            ring = 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes * link.beta
            tree = 2 * math.ceil(math.log2(n)) * link.alpha + 2 * nbytes * link.beta
            return tree if self.algorithm == "tree" else ring
        if op in ("all_gather", "reduce_scatter"):
            return (n - 1) * link.alpha + (n - 1) / n * nbytes * link.beta
        if op == "broadcast":       # pipelined down a ring/tree: latency log N, the bytes once
            return math.ceil(math.log2(n)) * link.alpha + nbytes * link.beta
        if op == "barrier":
            return 2 * (n - 1) * link.alpha
        raise ConfigError(f"ddplab.plan: no α-β cost for {op!r}; use all_reduce, all_gather, "
                          f"reduce_scatter, broadcast, barrier or send.")


INTERCONNECTS: dict[str, Network] = {
    # NVLink 4 (H100 SXM): ~450 GB/s each way, ~360 GB/s reached by NCCL's busbw; InfiniBand NDR
    # 400 Gb/s = 50 GB/s per GPU, ~40 GB/s reached. α: a few µs per step inside a node, more across.
    "nvlink+ib": Network("NVLink in nodes of 8, 400 Gb/s InfiniBand between",
                         Link(3e-6, 1 / 360e9), Link(8e-6, 1 / 40e9), per_node=8),
    "pcie+ethernet": Network("PCIe in nodes of 8, 100 Gb/s Ethernet between",
                             Link(5e-6, 1 / 20e9), Link(30e-6, 1 / 10e9), per_node=8),
}


def torch_guess(op: str, nbytes: float, group: int, span: int | None = None,
                per_node: int = 8) -> float | None:
    """Seconds torch's DTensor cost model gives the collective; None for ops it does not model."""
    from torch.distributed.tensor import _collective_utils as costs

    cost = {"all_reduce": costs.allreduce_cost, "all_gather": costs.allgather_cost,
            "reduce_scatter": costs.reduce_scatter_cost}.get(op)
    if cost is None or group <= 1:
        return None if cost is None else 0.0
    # build_from_mesh's rule, without the DeviceMesh it would need (its cost functions read only this)
    across = (span or group) > per_node
    topo = costs.MeshTopoInfo(None, [group], [87.7 * (0.22 if across else 1.0)],
                              [2.7 if across else 0.6])
    return cost(nbytes / 2**30, topo, 0) * 1e-6
