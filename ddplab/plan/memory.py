"""Step 1 of a plan: each rank's memory and FLOPs, measured by torch on a fake process group.

    measure(config, [("fsdp", 64), ("ddp", 8)])     # {("fsdp", 64): {...}, ("ddp", 8): {...}}

No formula guesses the bytes here. For each strategy and world size N, a
child process (run by ``ddplab.procs.run_command``):

1. (``ddplab.plan.memory.main``) joins a *fake* process group of N ranks as rank 0
   (``dist.init_process_group("fake", store=FakeStore())``: collectives return
   at once and move nothing), so FSDP, DTensor and ZeroRedundancyOptimizer
   shard exactly as they would on N ranks;
2. builds the model under ``FakeTensorMode`` (shapes, no memory: a 1B model
   costs nothing) and applies the strategy with torch's own code:
   ``parallelize_module`` for tp, ``fully_shard`` for fsdp,
   ``ZeroRedundancyOptimizer`` for zero1;
3. runs two training steps under torch's memory tracker (``FSDPMemTracker``
   for fsdp, ``MemTracker`` otherwise), which sorts every tensor it sees into
   parameters, gradients, optimizer state, activations and temporaries, and
   under ``FlopCounterMode``, which counts the FLOPs of the forward and backward.

What comes back, per case: ``peak`` (the most the rank held at once) and
``at_peak`` (its split at that moment), ``state`` (the split after the
optimizer step: what lives between steps), ``activations`` (what the forward
left for backward, read when the forward ended), ``flops`` and ``source``.

Where torch cannot do it, the number says what it comes from (``source``):

- ddp: DDP's C++ reducer cannot hold fake tensors, so the *local model* is
  traced: DDP shards nothing, and with ``gradient_as_bucket_view=True`` its
  buckets are the gradients (the default, False, adds one more copy of them);
- ppP: the first stage is traced on one microbatch (it holds the embedding and
  ``layers/P`` blocks); under 1F1B it keeps P microbatches' activations alive,
  so its activations are the traced ones times min(P, microbatches).

It runs in children (one per core, up to 4) so that the fake group never replaces a real lab's default
process group in the notebook's kernel. What the children change in torch to trace fast, or at all
(``ddplab.plan.patches``): a tracker that keeps the peak only, meshes joined with fake mode off,
and of FSDP2's world_size chunks of each parameter only the ones it reads made.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from typing import Any

from ..errors import DdplabError
from .models import Config, stage
from .patches import one_chunk_each, peak_only, real_meshes
from .strategies import Strategy, parse

__all__ = ["CATEGORIES", "flops", "main", "measure", "trace"]

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
_TP_PLAN = {"gpt": {"attn.qkv": "col", "attn.proj": "row", "mlp.fc1": "col", "mlp.fc2": "row"},
            "mlp": {"fc1": "col", "fc2": "row"}}


def _split(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporary"), 0)
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            name = getattr(key, "value", key)
            if name in CATEGORIES:
                out[CATEGORIES[name]] += int(nbytes)
    return out


def trace(config: Config, strategy: Strategy, world_size: int) -> dict[str, Any]:
    """In this process: rank 0's memory and FLOPs for one step; needs no default group yet."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    replicas, tp, pp = strategy.replicas(world_size), strategy.tp, strategy.pp
    microbatches = config.batch if pp > 1 else 1
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        # rank 0's groups: its stage's replicas (dp) and the ranks that share its layers (tp)
        mesh = init_device_mesh("cpu", (pp, replicas, tp), mesh_dim_names=("pp", "dp", "tp"))
        with FakeTensorMode(allow_non_fake_inputs=True):   # the mesh's rank table is real
            model = config.build()
            if pp > 1:
                stage(model, 0, config.layers // pp)
            if tp > 1:
                _tensor_parallel(model, config, mesh["tp"])
            if strategy.data == "fsdp":
                with real_meshes(), one_chunk_each():
                    from torch.distributed.fsdp import fully_shard
                    for block in model.blocks:
                        fully_shard(block, mesh=mesh["dp"])
                    fully_shard(model, mesh=mesh["dp"])
            optimizer = _optimizer(model, config, strategy, mesh["dp"])
            x = config.batch_for(config.batch // microbatches)
            # The optimizer's state made as its first step makes it (from zero gradients, no
            # forward needed), so the tracked step holds what every later step of training holds.
            for parameter in model.parameters():
                parameter.grad = torch.zeros_like(parameter)
            optimizer.step()
            optimizer.zero_grad()
            tracker = (peak_only(FSDPMemTracker)(model, optimizer) if strategy.data == "fsdp"
                       else peak_only(MemTracker)())
            if strategy.data != "fsdp":
                tracker.track_external(model, optimizer)
            with tracker:
                loss = model(x).float().sum()
                forward = _split(tracker.get_tracker_snapshot("current"))
                loss.backward()
                optimizer.step()
                state = _split(tracker.get_tracker_snapshot("current"))
                optimizer.zero_grad()
                peak = tracker.get_tracker_snapshot("peak")
        split, in_flight = _split(peak), min(pp, microbatches)
        activations = forward["activations"] * in_flight
        source = {"fsdp": "traced at this size (FSDPMemTracker)",
                  "zero1": "traced at this size: the local model, ZeroRedundancyOptimizer (MemTracker)",
                  "ddp": "traced: the local model (MemTracker), DDP's buckets as its gradients",
                  }[strategy.data]
        if pp > 1:
            source += f"; stage 0 of {pp}, activations x {in_flight} microbatches in flight (1F1B)"
        if pp > 1:            # the peak with the other microbatches' activations alive too
            split["activations"] += activations - forward["activations"]
        if tp > 1:
            source += f"; FLOPs: the count / {tp} (FlopCounterMode sees DTensor's global shapes)"
        return {"peak": sum(split.values()), "at_peak": split, "state": state,
                "activations": activations,
                "flops": flops(config, strategy, world_size) * microbatches,
                "parameters": sum(p.numel() for p in model.parameters()),
                "microbatches": microbatches, "replicas": replicas, "source": source}
    finally:
        dist.destroy_process_group()


@cache
def flops(config: Config, strategy: Strategy, world_size: int) -> int:
    """FLOPs of one microbatch's forward and backward on one rank (``FlopCounterMode``),
    counted on the stage without data parallelism, which changes no rank's FLOPs; a tp
    count is divided by tp: the counter sees DTensor's global shapes. Once per stage and tp."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    if strategy.tp > 1 or strategy.data != "ddp":   # data parallelism changes no rank's FLOPs
        return flops(config, Strategy("ddp", 1, strategy.pp), 1) // strategy.tp
    microbatches = config.batch if strategy.pp > 1 else 1
    with FakeTensorMode(), FlopCounterMode(display=False) as counter:
        model = config.build()
        if strategy.pp > 1:
            stage(model, 0, config.layers // strategy.pp)
        model(config.batch_for(config.batch // microbatches)).float().sum().backward()
    return int(counter.get_total_flops())


def _tensor_parallel(model: Any, config: Config, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = {"col": ColwiseParallel, "row": RowwiseParallel}
    plan = {name: style[how]() for name, how in _TP_PLAN["mlp" if config.kind == "mlp" else "gpt"].items()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)


def _optimizer(model: Any, config: Config, strategy: Strategy, group_mesh: Any) -> Any:
    import torch

    kind = torch.optim.Adam if config.optimizer == "adam" else torch.optim.SGD
    options = {"lr": 1e-3} if config.optimizer == "adam" else {"lr": 1e-3, "momentum": 0.0}
    if strategy.data == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind,
                                       process_group=group_mesh.get_group(), **options)
    # foreach, as on a GPU (CUDA's default); under tp the DTensors in a group of their own:
    # one foreach op cannot mix them with the plain embedding and head
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [{"params": [p for p in params if isinstance(p, DTensor) == split]} for split in (True, False)]
    return kind([g for g in groups if g["params"]], foreach=True, **options)


# ------------------------------------------------------------ in the kernel
def measure(config: Config, cases: list[tuple[str, int]],
            timeout: float = 600) -> dict[tuple[str, int], dict]:
    """Trace every (strategy, world size), in one child process per core (a strategy's cases
    stay in one: ddp's are traced once); a case torch cannot trace comes back as
    ``{"error": ...}``, not as an exception."""
    import os
    from pathlib import Path

    from .. import procs

    by_strategy: dict[str, list] = {}
    for strategy, n in cases:
        by_strategy.setdefault(parse(strategy).name, []).append([parse(strategy).name, n])
    workers = max(1, min(len(os.sched_getaffinity(0)), 4, len(by_strategy)))
    shares: list[list] = [[] for _ in range(workers)]
    for group in sorted(by_strategy.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)               # the biggest first, to the emptiest
    here = str(Path(__file__).resolve().parents[2])          # where this ddplab is imported from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    child = "import sys; from ddplab.plan.memory import main; sys.exit(main(sys.argv[1:]))"
    commands = [[sys.executable, "-c", child, json.dumps({"config": config.to_dict(), "cases": share})]
                for share in shares]
    done = procs.run(commands, timeout, env=env, output="all")
    results = {}
    for ended in done:
        for line in ended.output.splitlines():
            if line.startswith('{"strategy"'):
                row = json.loads(line)
                results[(row.pop("strategy"), row.pop("world_size"))] = row
    if not done.ok or len(results) < len(cases):
        tail = "\n".join(line for ended in done for line in ended.output.strip().splitlines()[-8:]
                         if not line.startswith('{"strategy"'))
        raise DdplabError(f"ddplab.plan: the children that trace memory ended with codes "
                          f"{done.returncodes} after {len(results)} of {len(cases)} cases:\n{tail}\n"
                          f"Try fewer or smaller cases, or call ddplab.plan.memory.trace in a "
                          f"fresh process to see the error.")
    return results


def main(argv: list[str] | None = None) -> int:
    """The child: one JSON line per case on stdout."""
    import warnings

    warnings.filterwarnings("ignore")          # FSDP's view warning, once per case, is noise here
    request = json.loads((argv or sys.argv[1:])[0])
    config = Config(**request["config"])
    done: dict[str, dict] = {}
    for name, world_size in request["cases"]:
        strategy = parse(name)
        if strategy.data == "ddp" and name in done:   # ddp shards nothing: the same at every size
            row = dict(done[name], replicas=strategy.replicas(world_size))
        else:
            try:
                row = trace(config, strategy, world_size)
            except Exception as e:                    # a strategy torch cannot trace: say so, go on
                row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            done[name] = row
        print(json.dumps({"strategy": name, "world_size": world_size, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
