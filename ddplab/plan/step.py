"""Step 4 of a plan: one training step's time, split into compute, communication and the bubble.

    step = compute + exposed communication + pipeline bubble

``compute`` is ``ddplab.plan.compute``'s (FLOPs / (peak × efficiency)), a third
forward and two thirds backward; the FLOPs are one micro-batch's, times the micro-batches.
Each strategy's collectives
(``ddplab.plan.strategies``' table) are timed by the network's α-β model and
then split into what hides behind compute and what is *exposed*:

- ddp: the gradient all_reduce runs during backward, bucket by bucket; exposed
  is what outlasts backward, plus the last bucket (ready only when backward ends);
- zero1: as ddp, plus the all_gather of the updated parameters after the step;
- fsdp: each layer's all_gather is prefetched during the previous layer's
  compute, its reduce_scatter runs during the next one's backward: exposed is
  what outlasts forward/backward, plus the first layer's all_gather and the last
  one's reduce_scatter;
- tp: every all_reduce of activations is exposed (the next matmul needs it);
- on a device that cannot overlap (``this-cpu``: gloo shares the cores) all of it is;
- zero2: as fsdp, without backward's all_gather (the weights stayed whole);
- pp: 1F1B on M micro-batches idles each rank for (P-1) micro-batch times, the
  bubble ``(P-1)/M × compute``, interleaved over V stages per rank ``(P-1)/(V·M)``
  (``ddplab.plan.pipeline_schedule``); of its sends, the first and last are exposed.

Simplifications, said once: no congestion (every group has its links to
itself), no per-kernel timing, overlap as perfect as the rules above say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .compute import Device
from .models import Config
from .network import Network, torch_guess
from .pipeline_schedule import bubble
from .precision import RECIPES
from .strategies import Strategy

__all__ = ["Step", "collectives", "step"]

_BUCKET = 25 * 2**20          # DDP's bucket_cap_mb


@dataclass
class Step:
    compute: float = 0.0
    communication: float = 0.0     # every collective's α-β time, hidden or not
    exposed: float = 0.0
    bubble: float = 0.0
    torch_communication: float = 0.0   # the same collectives by torch's DTensor cost model
    calls: list = field(default_factory=list)   # (op, bytes, group, seconds, phase)

    @property
    def hidden(self) -> float:
        return self.communication - self.exposed

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.bubble


def collectives(strategy: Strategy, config: Config, world_size: int,
                parameters: int) -> list[tuple[str, float, int, int, str]]:
    """(op, bytes, group, span, phase) of one step on one rank; ``parameters``: the rank's
    stage's parameter count (before any fsdp/zero sharding; tensor parallelism divides it).
    Gradients travel in the compute dtype under ddp and zero1, in the recipe's ``reduce``
    dtype under fsdp and zero2 (``MixedPrecisionPolicy.reduce_dtype``); weights are gathered
    in the compute dtype."""
    recipe = RECIPES[config.precision]
    item = recipe.bytes("param")
    d, t, p = strategy.replicas(world_size), strategy.tp, strategy.pp
    weights = parameters / t
    microbatches = config.microbatches if p > 1 else 1
    sequences = config.microbatch if p > 1 else config.batch
    act = sequences * config.seq * config.d_model * item
    out = []
    if strategy.data in ("ddp", "zero1"):
        out.append(("all_reduce", weights * item, d, d * t, "backward"))
    if strategy.data == "zero1":
        out.append(("all_gather", weights * item, d, d * t, "after"))
    if strategy.data in ("fsdp", "zero2"):
        scatter = weights * (recipe.bytes("reduce") if recipe.master else item)
        out.append(("all_gather", weights * item, d, d * t, "forward"))
        if strategy.data == "fsdp" and p == 1:      # under a pipeline, gathered once per step
            out.append(("all_gather", weights * item, d, d * t, "backward"))
        out.append(("reduce_scatter", scatter, d, d * t, "backward"))
    layers = -(-config.layers // p)
    per_layer = 6 if config.checkpointing == "full" else 4      # full recomputes forward's two
    for _ in range(microbatches if t > 1 else 0):
        out += [("all_reduce", act, t, t, "tp")] * (per_layer * layers)
    if p > 1:
        out += [("send", act, 2, 2, "pp")] * (2 * microbatches * strategy.virtual)
    return out


def step(strategy: Strategy, config: Config, world_size: int, flops: float, parameters: int,
         device: Device, network: Network) -> Step:
    """The step time of the pipeline rank that computes most (the only one without a pipeline)."""
    microbatches = config.microbatches if strategy.pp > 1 else 1
    s = Step(compute=device.seconds(flops * microbatches, config.dtype))
    forward, backward = s.compute / 3, 2 * s.compute / 3
    phase: dict[str, float] = {}
    for op, nbytes, group, span, when in collectives(strategy, config, world_size, parameters):
        seconds = network.seconds(op, nbytes, group, span)
        guess = torch_guess(op, nbytes, group, span, network.per_node)
        s.communication += seconds
        s.torch_communication += seconds if guess is None else guess
        phase[when] = phase.get(when, 0.0) + seconds
        s.calls.append((op, nbytes, group, seconds, when))
    layers = max(1, config.layers // strategy.pp)
    d = strategy.replicas(world_size)
    weights = parameters * RECIPES[config.precision].bytes("param") / strategy.tp
    span = d * strategy.tp
    if strategy.data in ("ddp", "zero1"):
        last = network.seconds("all_reduce", min(_BUCKET, weights), d, span)
        s.exposed += min(phase["backward"], max(0.0, phase["backward"] - backward) + last)
        s.exposed += phase.get("after", 0.0)
    else:
        first = network.seconds("all_gather", weights / layers, d, span)
        final = network.seconds("reduce_scatter", weights / layers, d, span)
        s.exposed += min(phase["forward"], max(0.0, phase["forward"] - forward) + first)
        s.exposed += min(phase["backward"], max(0.0, phase["backward"] - backward) + final)
    s.exposed += phase.get("tp", 0.0)
    if strategy.pp > 1:
        s.bubble = bubble(strategy.pp, strategy.virtual, microbatches) * s.compute
        s.exposed += phase["pp"] / (microbatches * strategy.virtual)   # the first and last sends
    if not device.overlap:               # e.g. gloo on the cores that compute: nothing hides
        s.exposed = s.communication
    return s
