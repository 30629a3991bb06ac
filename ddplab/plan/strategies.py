"""The strategies a plan compares, and what each sends per step.

    parse("fsdp")           # Strategy(data="fsdp", tp=1, pp=1)
    parse("tp8+fsdp")       # tensor parallel over 8 ranks, FSDP over the rest
    parse("pp4+zero1")      # 4 pipeline stages, ZeRO-1 within each stage's replicas

A strategy is one way of splitting the data-parallel replicas (``ddp``,
``zero1``, ``fsdp``), optionally composed with tensor parallelism (``tpT``)
and pipeline parallelism (``ppP``). On ``N`` ranks: ``T`` ranks share each
layer, ``P`` stages share the layers, and ``D = N / (T*P)`` replicas share
the batch. Each replica trains ``config.batch`` sequences per step (weak
scaling: the global batch grows with D).

What each one sends per step, per rank, the sizes in bytes of *its* shard of
the model (``W``: parameter bytes after tensor and pipeline splits):

=========  ===========================================  ==========================
ddp        all_reduce(W) of gradients over D             overlaps backward (buckets)
zero1      all_reduce(W), then all_gather(W) of the       the all_gather after the
           updated parameters (torch's                    optimizer step is exposed
           ZeroRedundancyOptimizer broadcasts them)
fsdp       all_gather(W) forward, all_gather(W) and       prefetched: overlaps compute,
           reduce_scatter(W) backward                     all but the first layer's
tpT        2 all_reduce of the activations per layer      exposed: the next matmul
           forward, 2 backward, over T                    needs the result
ppP        a send of the activations per microbatch       mostly hidden; the bubble is
           between stages                                 (P-1) microbatch times
=========  ===========================================  ==========================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DATA", "Strategy", "parse"]

DATA = ("ddp", "zero1", "fsdp")
_PART = re.compile(r"^(tp|pp)(\d+)$")


@dataclass(frozen=True)
class Strategy:
    """``data`` over the replicas, ``tp``-way tensor and ``pp``-way pipeline parallelism."""
    data: str = "ddp"
    tp: int = 1
    pp: int = 1

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"] * (self.tp > 1) + [f"pp{self.pp}"] * (self.pp > 1)
        return "+".join(parts + [self.data])

    def replicas(self, world_size: int) -> int:
        """D: how many data-parallel replicas ``world_size`` ranks make; 0 if they cannot."""
        model_ranks = self.tp * self.pp
        return world_size // model_ranks if world_size % model_ranks == 0 else 0

    def check(self, world_size: int, layers: int, heads: int) -> str | None:
        """Why this strategy cannot run at ``world_size`` on the model, or None."""
        if self.replicas(world_size) == 0:
            return f"{world_size} ranks are not a multiple of tp*pp = {self.tp * self.pp}"
        if layers % self.pp:
            return f"{layers} layers do not split into {self.pp} equal stages"
        if heads % self.tp:
            return f"{heads} heads do not split over tp={self.tp}"
        return None


def parse(text: str | Strategy) -> Strategy:
    """``"tp8+pp2+fsdp"`` -> Strategy; the parts in any order, the data part once at most."""
    if isinstance(text, Strategy):
        return text
    data, sizes = None, {"tp": 1, "pp": 1}
    for part in str(text).lower().replace(" ", "").split("+"):
        found = _PART.match(part)
        if part in DATA and data is None:
            data = part
        elif found and int(found.group(2)) >= 1:
            sizes[found.group(1)] = int(found.group(2))
        else:
            raise ConfigError(f"ddplab.plan: cannot read the strategy {text!r} (the part {part!r}): "
                              f"write one of {', '.join(DATA)}, optionally with tpN and ppN, "
                              f"joined by '+', e.g. 'fsdp', 'tp8+fsdp', 'pp4+ddp'.")
    return Strategy(data or "ddp", sizes["tp"], sizes["pp"])
