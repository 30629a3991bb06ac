"""The strategies a plan compares, and what each sends per step.

    parse("fsdp")           # Strategy(data="fsdp", tp=1, pp=1)
    parse("tp8+fsdp")       # tensor parallel over 8 ranks, FSDP over the rest
    parse("pp8v2+tp8+fsdp") # 8 pipeline ranks of 2 stages each (interleaved 1F1B), tp 8, FSDP

A strategy is one way of splitting the data-parallel replicas (``ddp``, ``zero1``,
``zero2``, ``fsdp``), optionally composed with tensor parallelism (``tpT``) and
pipeline parallelism (``ppP``, or ``ppPvV`` for V stages per rank). On ``N`` ranks:
``T`` ranks share each layer, ``P`` ranks share the layers, and ``D = N / (T*P)``
replicas share the batch. Each replica trains ``config.batch`` sequences per step
(weak scaling: the global batch grows with D). Each part is written once; the
parts may come in any order.

What each one sends per step, per rank, the sizes in bytes of *its* shard of
the model (``W``: parameter bytes after tensor and pipeline splits):

=========  ===========================================  ==========================
ddp        all_reduce(W) of gradients over D             overlaps backward (buckets)
zero1      all_reduce(W), then all_gather(W) of the       the all_gather after the
           updated parameters (torch's                    optimizer step is exposed
           ZeroRedundancyOptimizer broadcasts them)
zero2      all_gather(W) forward, reduce_scatter(W)       as fsdp, without backward's
           backward (FSDP2, reshard_after_forward=False)  all_gather
fsdp       all_gather(W) forward, all_gather(W) and       prefetched: overlaps compute,
           reduce_scatter(W) backward                     all but the first layer's
tpT        2 all_reduce of the activations per layer      exposed: the next matmul
           forward, 2 backward, over T                    needs the result
ppP        a send of the activations per micro-batch      mostly hidden; the bubble is
           between stages                                 (P-1)/(V·M) of the compute
=========  ===========================================  ==========================

Tensor parallelism composes with fsdp and zero2 only: torch's DDP and
ZeroRedundancyOptimizer take plain tensors, not the DTensors ``parallelize_module``
makes (such a row says so).

Context parallelism (``cpC``) is read, and its rows say why the planner has no numbers for it: torch 2.13's
``context_parallel`` swaps in ring attention only for the GPU attention ops
(``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``);
on a CPU ``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
which its dispatcher refuses ("CP only supports flash attention and memory efficient
attention now"), so the planner cannot trace it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DATA", "Strategy", "parse"]

DATA = ("ddp", "zero1", "zero2", "fsdp")
_PART = re.compile(r"^(tp|pp|cp)(\d+)(?:v(\d+))?$")
_EXAMPLES = "e.g. 'fsdp', 'zero2', 'tp8+fsdp', 'pp4+ddp', 'pp8v2+tp8+fsdp'"
CP_WHY = ("torch 2.13's context_parallel swaps in ring attention only for the GPU attention ops; on a "
          "CPU scaled_dot_product_attention runs aten._scaled_dot_product_flash_attention_for_cpu, which "
          "its dispatcher refuses, so the planner cannot trace context parallelism here")


@dataclass(frozen=True)
class Strategy:
    """``data`` over the replicas, ``tp``-way tensor and ``pp``-way pipeline parallelism,
    ``virtual`` pipeline stages per pipeline rank (interleaved 1F1B when > 1)."""
    data: str = "ddp"
    tp: int = 1
    pp: int = 1
    virtual: int = 1
    cp: int = 1

    @property
    def name(self) -> str:
        pipe = f"pp{self.pp}" + (f"v{self.virtual}" if self.virtual > 1 else "")
        parts = ([f"tp{self.tp}"] * (self.tp > 1) + [pipe] * (self.pp > 1)
                 + [f"cp{self.cp}"] * (self.cp > 1))
        return "+".join(parts + [self.data])

    def replicas(self, world_size: int) -> int:
        """D: how many data-parallel replicas ``world_size`` ranks make; 0 if they cannot."""
        model_ranks = self.tp * self.pp * self.cp
        return world_size // model_ranks if world_size % model_ranks == 0 else 0

    def check(self, world_size: int, config: object) -> str | None:
        """Why this strategy cannot run at ``world_size`` on ``config``'s model, or None."""
        layers, stages = config.layers, self.pp * self.virtual   # type: ignore[attr-defined]
        if self.cp > 1:
            return CP_WHY
        if self.tp > 1 and self.data in ("ddp", "zero1"):
            which = "DDP" if self.data == "ddp" else "ZeroRedundancyOptimizer"
            return (f"torch's {which} takes plain tensors, "
                    f"not tensor parallelism's DTensors (torchtitan refuses DDP with more than one "
                    f"dimension): tp goes with fsdp or zero2")
        if self.replicas(world_size) == 0:
            return f"{world_size} ranks are not a multiple of tp*pp = {self.tp * self.pp}"
        if self.pp > 1 and layers < stages:
            return f"{layers} layers cannot fill {stages} pipeline stages"
        if self.pp > 1 and config.microbatches < self.pp:   # type: ignore[attr-defined]
            return (f"{config.microbatches} micro-batches cannot fill {self.pp} pipeline ranks "   # type: ignore[attr-defined]
                    f"(torch's 1F1B needs at least as many): a bigger batch or a smaller microbatch")
        if self.virtual > 1 and config.microbatches % max(1, config.microbatches // self.pp):   # type: ignore[attr-defined]
            return "interleaved 1F1B needs the micro-batches in whole rounds of pp"
        heads = config.heads if config.kind != "mlp" else config.hidden   # type: ignore[attr-defined]
        kv = config.kv if config.kind == "llama" else heads               # type: ignore[attr-defined]
        if heads % self.tp or kv % self.tp:
            return f"{heads} heads ({kv} key/value heads) do not split over tp={self.tp}"
        if config.kind == "llama" and self.tp > 1 and config.seq % self.tp:   # type: ignore[attr-defined]
            return f"seq={config.seq} does not split over tp={self.tp} (sequence parallelism)"   # type: ignore[attr-defined]
        return None


def parse(text: str | Strategy) -> Strategy:
    """``"tp8+pp2+fsdp"`` -> Strategy: the parts in any order, each at most once."""
    if isinstance(text, Strategy):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"ddplab.plan: a strategy is a string such as 'fsdp' or 'tp8+fsdp', got "
                          f"{text!r} ({type(text).__name__}).")
    data, sizes, seen = None, {"tp": 1, "pp": 1, "cp": 1, "v": 1}, set()

    def refuse(part: str, why: str) -> ConfigError:
        return ConfigError(f"ddplab.plan: cannot read the strategy {text!r} (the part {part!r}: "
                           f"{why}): write one of {', '.join(DATA)}, optionally with tpN and ppN "
                           f"(ppNvV: V stages per rank), each once, joined by '+', {_EXAMPLES}.")

    for part in text.lower().replace(" ", "").split("+"):
        found = _PART.match(part)
        kind = part if part in DATA else (found.group(1) if found else None)
        if kind is None:
            raise refuse(part, "not a strategy")
        if kind in seen or (kind in DATA and data is not None):
            raise refuse(part, "given twice" if kind in seen else f"a second data strategy after {data!r}")
        seen.add(kind)
        if kind in DATA:
            data = kind
            continue
        size, virtual = int(found.group(2)), found.group(3)
        if size < 1 or (virtual is not None and int(virtual) < 1):
            raise refuse(part, "sizes are 1 or more")
        if virtual is not None and kind != "pp":
            raise refuse(part, "only pp has stages per rank (ppNvV)")
        sizes[kind] = size
        if virtual is not None:
            sizes["v"] = int(virtual)
    return Strategy(data or "ddp", sizes["tp"], sizes["pp"], sizes["v"] if sizes["pp"] > 1 else 1,
                    sizes["cp"])
