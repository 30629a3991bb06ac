"""Step 1 of a plan: each rank's memory and FLOPs, measured by torch on a fake process group.

    trace(config, parse("fsdp"), 64)     # in a fresh process: rank 0's bytes by kind, its FLOPs

No formula guesses the bytes here. For one strategy and world size N, in a child
process (``ddplab.plan.children`` runs them):

1. join a *fake* process group of N ranks as rank 0 (``init_process_group("fake",
   store=FakeStore())``: collectives return at once and move nothing), so FSDP,
   DTensor and ZeroRedundancyOptimizer shard exactly as they would on N ranks;
2. build the model under ``FakeTensorMode`` (shapes, no memory: a 405B model costs
   nothing) and apply the strategy with torch's own code (``ddplab.plan.parallelize``:
   ``parallelize_module``, ``torch.utils.checkpoint``, ``fully_shard``,
   ``ZeroRedundancyOptimizer``), in the precision the config's recipe says;
3. run one training step under torch's memory tracker (``FSDPMemTracker`` for
   fsdp and zero2, ``MemTracker`` otherwise), which sorts every tensor it sees into
   parameters, gradients, optimizer state, activations and temporaries. The optimizer
   state is made first, by a step from zero gradients, as the first step of training
   makes it, so the tracked step holds what every later step holds.

What comes back: ``peak`` (the most the rank held at once) and ``at_peak`` (its split
then), ``state`` (the split after the optimizer step: what lives between steps),
``model_states`` (the most parameters + gradients + optimizer state held at once: the
ZeRO paper's "model states"), ``activations`` (what the forward left for backward),
``flops`` and ``source``.

Where torch cannot do it, the number says what it comes from (``source``):

- ddp: DDP's C++ reducer cannot hold fake tensors, so the local model is traced;
- ppP: each end of the pipeline (rank 0, with the embedding, and the last rank, with
  the head and the loss) is traced on one micro-batch (under fsdp two: one without
  gradient sync, as torch's ``PipelineStage`` runs all but the last, its weights whole
  and its unsharded gradients accumulating, then the last); a rank keeps the activations
  of several micro-batches alive (``ddplab.plan.pipeline_schedule.in_flight``), so its
  activations are the traced ones times that; the row is the rank with the bigger peak.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from . import pipeline_schedule as schedule, recompute
from .models import Config
from .modules import build, loss, stage
from .parallelize import fully_shard_all, optimizer, tensor_parallel
from .patches import one_chunk_each, peak_only, propagation_apart, real_meshes
from .precision import RECIPES
from .strategies import Strategy

__all__ = ["CATEGORIES", "trace"]

# torch's tracker categories (MemTracker's and FSDPMemTracker's) -> the plan's five.
CATEGORIES = {
    "Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
    "Unsharded Param": "parameters", "All Gather": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporary", "Other": "temporary",
}


def split(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {category: bytes}}) in the plan's five kinds."""
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporary"), 0)
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            name = getattr(key, "value", key)
            if name in CATEGORIES:
                out[CATEGORIES[name]] += int(nbytes)
    return out


def trace(config: Config, strategy: Strategy, world_size: int) -> dict[str, Any]:
    """In this process: the memory of one step on the rank that holds the most (rank 0, or
    under a pipeline whichever end holds more); needs no default process group yet."""
    if strategy.pp == 1:
        return _rank(config, strategy, world_size, 0)
    ends = [_rank(config, strategy, world_size, rank) for rank in (0, strategy.pp - 1)]
    worst = max(ends, key=lambda row: row["peak"])
    worst["source"] += "; the row: the end of the pipeline with the bigger peak"
    worst["peaks"] = [row["peak"] for row in ends]
    return worst


SAMPLES = (3, 4, 5)        # blocks traced to fit a line (the first two) and check it (the last)


def _rank(config: Config, strategy: Strategy, world_size: int, rank: int) -> dict[str, Any]:
    """Pipeline rank ``rank``'s row, from its numbers (``_numbers``)."""
    numbers, how = _numbers(config, strategy, world_size, rank)
    return _finish(numbers, config, strategy, rank, how)


def _numbers(config: Config, strategy: Strategy, world_size: int, rank: int) -> tuple[dict, str]:
    """Pipeline rank ``rank``'s flat numbers, and how they were had. Its blocks are identical,
    so each number (the peak of forward and backward, the optimizer step's, the state, the
    activations) is a + b x blocks once the first and last block are in place: traced with 3
    and 4 blocks, the line is checked against a trace with 5 (every number must fall on it, to
    the byte) and read at the rank's count. Where it does not fall on the line, or the rank has
    few blocks, the rank is traced whole.

    zero1: forward and backward are ddp's (the same local model, the same gradients), its
    optimizer state in place of ddp's (it does not change while they run); the optimizer's step,
    which ZeroRedundancyOptimizer's split by whole parameters makes depend on all of them, is
    traced on the whole model (``tests/test_plan_memory.py`` checks this against a whole trace)."""
    if strategy.data == "ddp" and world_size != strategy.tp * strategy.pp:
        return _local(config, strategy, rank)       # the same at every size: once per process
    if strategy.data == "zero1":
        local, how = _local(config, Strategy("ddp", strategy.tp, strategy.pp, strategy.virtual), rank)
        step = _measure(config, strategy, world_size, rank, None, forward_backward=False)
        numbers = dict(local)
        change = step["state.optimizer"] - local["state.optimizer"]
        for key in ("through.optimizer", "forward.optimizer", "through.states"):
            numbers[key] += change
        numbers.update({k: v for k, v in step.items() if k.startswith(("stepped.", "state."))})
        return numbers, f"forward and backward as ddp's ({how}), the step traced whole"
    blocks = (len(schedule.layers_of(config.layers, strategy.pp, strategy.virtual, rank))
              if strategy.pp > 1 else config.layers)
    how = "traced whole"
    if blocks > sum(SAMPLES):
        got = {k: _measure(config, strategy, world_size, rank, k) for k in SAMPLES}
        a, b, c = (got[k] for k in SAMPLES)
        if all(c[key] - b[key] == b[key] - a[key] for key in a):
            return ({key: a[key] + (b[key] - a[key]) * (blocks - SAMPLES[0]) for key in a},
                    f"traced with {SAMPLES[0]} and {SAMPLES[1]} blocks, checked with {SAMPLES[2]}, "
                    f"read at {blocks}")
        how = f"traced whole ({SAMPLES} blocks did not fall on a line)"
    return _measure(config, strategy, world_size, rank, None), how


@cache
def _local(config: Config, strategy: Strategy, rank: int) -> tuple[dict, str]:
    """ddp's numbers (the local model's: the same at every world size), once per process."""
    return _numbers(config, strategy, strategy.tp * strategy.pp, rank)


def _finish(numbers: dict[str, int], config: Config, strategy: Strategy, rank: int,
            how: str) -> dict[str, Any]:
    """The row from the flat numbers: a pipeline rank's other micro-batches' activations are
    alive through forward and backward, not in the optimizer's step."""
    kinds = ("parameters", "gradients", "optimizer", "activations", "temporary")
    part = {phase: {k: numbers[f"{phase}.{k}"] for k in kinds}
            for phase in ("through", "stepped", "state", "forward")}
    held = schedule.in_flight(strategy.pp, strategy.virtual, config.microbatches, rank)
    activations = round(part["forward"]["activations"] * held)
    part["through"]["activations"] += activations - part["forward"]["activations"]
    peak = max(part["through"], part["stepped"], key=lambda split: sum(split.values()))
    return {"peak": sum(peak.values()), "at_peak": peak, "state": part["state"],
            "model_states": max(numbers["through.states"], numbers["stepped.states"]),
            "activations": activations, "parameters": numbers["parameters"], "pipeline_rank": rank,
            "source": _source(config, strategy, rank, held) + f"; {how}"}


def _measure(config: Config, strategy: Strategy, world_size: int, rank: int,
             blocks: int | None, forward_backward: bool = True) -> dict[str, int]:
    """One traced step of pipeline rank ``rank`` (``blocks``: a model of that many blocks with
    the rank's ends; None: the rank's own layers), as flat numbers: ``phase.kind`` bytes.
    ``forward_backward=False``: the optimizer's step alone, the gradients there as backward
    leaves them (the ``through`` and ``forward`` numbers are then what is held before it)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    replicas, tp, pp = strategy.replicas(world_size), strategy.tp, strategy.pp
    sharded = strategy.data in ("fsdp", "zero2")
    recipe = RECIPES[config.precision]
    first, last = rank == 0, rank == pp - 1
    small = config if blocks is None else config.but(layers=blocks)
    keep = (list(range(blocks)) if blocks is not None else
            schedule.layers_of(config.layers, pp, strategy.virtual, rank) if pp > 1 else None)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        # rank 0's groups: its stage's replicas (dp) and the ranks that share its layers (tp)
        mesh = init_device_mesh("cpu", (pp, replicas, tp), mesh_dim_names=("pp", "dp", "tp"))
        # the mesh's rank table is real: fake tensors may meet it
        with FakeTensorMode(allow_non_fake_inputs=True), propagation_apart():
            model = build(small, (recipe.master or recipe.param) if sharded else recipe.param)
            if keep is not None:
                stage(model, keep, first, last)
            if tp > 1:
                tensor_parallel(model, config, mesh["tp"])
            recompute.apply(model, config.checkpointing)
            if sharded:
                with real_meshes(), one_chunk_each():
                    fully_shard_all(model, config, strategy, mesh["dp"])
            optim = optimizer(model, config, strategy, mesh["dp"])
            sequences = config.microbatch if pp > 1 else config.batch
            # a later stage takes what the one before sent: hidden states, sequence-sharded under tp
            tokens = config.seq // tp if tp > 1 and config.kind == "llama" else config.seq
            x = (config.batch_for(sequences) if first else
                 torch.randn(sequences, tokens, config.d_model, dtype=getattr(torch, recipe.param),
                             requires_grad=True))
            for parameter in model.parameters():      # Adam's state, as the first step makes it
                parameter.grad = torch.zeros_like(parameter)
            optim.step()
            optim.zero_grad()
            if not forward_backward:                  # the gradients backward would leave
                for parameter in model.parameters():
                    parameter.grad = torch.zeros_like(parameter)
            hooked = getattr(optim, "inner", optim)       # the torch optimizer (OnShards' inner)
            tracker = peak_only(_tracker_class(sharded))(*((model, hooked) if sharded else ()))
            if not sharded:     # ZeroRedundancyOptimizer keeps its state in its local .optim
                tracker.track_external(model, hooked, *[o for o in [getattr(hooked, "optim", None)] if o])
            # a pipeline stage under fsdp runs every micro-batch but the last without gradient sync
            # (torch's PipelineStage: set_requires_gradient_sync(False), set_reshard_after_backward(
            # False)): its weights stay whole and its unsharded gradients accumulate; then the last
            # micro-batch reduce-scatters them. Traced as two micro-batches: one of each.
            syncs = ((False, True) if pp > 1 and sharded else (True,)) if forward_backward else ()
            forward: dict[str, int] = {}
            with tracker:
                with _loss_parallel(config, last, tp > 1):
                    for sync in syncs:
                        if forward:                 # the tracker's per-module stats: one pass each
                            tracker.reset_mod_stats()
                        if len(syncs) > 1:
                            for setting in ("set_requires_gradient_sync", "set_reshard_after_backward",
                                            "set_is_last_backward"):
                                getattr(model, setting)(sync)
                        out = model(x)
                        out = loss(out, config) if last else out
                        forward = forward or split(tracker.get_tracker_snapshot("current"))
                        out.backward() if last else out.backward(torch.empty_like(out))
                        del out
                forward = forward or split(tracker.get_tracker_snapshot("current"))
                through = split(tracker.get_tracker_snapshot("peak"))      # forward and backward's
                through_states = getattr(tracker, "model_states", 0)
                getattr(tracker, "reset_peak", lambda: None)()
                optim.step()
                state = split(tracker.get_tracker_snapshot("current"))
                optim.zero_grad()
                stepped = split(tracker.get_tracker_snapshot("peak"))
        numbers = {f"{phase}.{k}": v for phase, kinds in (("through", through), ("stepped", stepped),
                                                          ("state", state), ("forward", forward))
                   for k, v in kinds.items()}
        numbers.update({"through.states": through_states,
                        "stepped.states": getattr(tracker, "model_states", 0),
                        "parameters": sum(p.numel() for p in model.parameters())})
        return numbers
    finally:
        dist.destroy_process_group()


def _loss_parallel(config: Config, last: bool, tp: bool) -> Any:
    """torch's ``loss_parallel`` around the forward and backward of the last stage under tp on
    Llama (torchtitan's ``train_context``): the vocabulary stays sharded through the loss."""
    from contextlib import nullcontext

    if not (last and tp and config.kind == "llama"):
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def _tracker_class(sharded: bool) -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    return FSDPMemTracker if sharded else MemTracker


def _source(config: Config, strategy: Strategy, rank: int, held: float) -> str:
    source = {"fsdp": "traced at this size (FSDPMemTracker)",
              "zero2": "traced at this size: fully_shard(reshard_after_forward=False) (FSDPMemTracker)",
              "zero1": "traced at this size: the local model, ZeroRedundancyOptimizer (MemTracker)",
              "ddp": "traced: the local model (MemTracker), DDP's buckets as its gradients",
              }[strategy.data]
    if RECIPES[config.precision].master and strategy.data in ("ddp", "zero1"):
        source += ", master weights in the optimizer's state"
    if strategy.pp > 1:
        name = "interleaved 1F1B" if strategy.virtual > 1 else "1F1B"
        source += (f"; pipeline rank {rank} of {strategy.pp} on one micro-batch, its activations "
                   f"x {held:g} micro-batches in flight ({name}, torch's schedule)")
    return source
