"""Plan a training run before you have the machines: memory per rank and step time, per strategy.

    p = ddplab.plan("llm-8b", world_sizes=[8, 64, 1024],
                    strategies=["ddp", "zero1", "fsdp", "tp8+fsdp", "pp4+fsdp"],
                    device="h100", network="nvlink+ib")
    p                       # the table: memory split, step time split, what fits
    p.picture()             # the same as bars
    p.advice()              # "64 ranks: does not fit in 80 GB: ddp. fastest that fits: fsdp ..."

    python -m ddplab.plan llm-8b --world-sizes 8 64 1024 --device h100

    fit = ddplab.bench.fit_ring(results)                    # your lab's α and β
    ddplab.plan("toy", [2, 4], ["ddp", "fsdp"], device="this-cpu", network=fit)

The steps, one module each (the order a plan is made in):

- ``models``: ``Config``, the model as a config (``CONFIGS``: toy, toy-wide, gpt-tiny,
  llm-1b, llm-8b, llama3.1-8b/70b/405b), its shape, precision recipe, checkpointing
  and batch; ``modules`` builds it with torch;
- ``inputs``: every argument checked before any work;
- ``memory`` (in ``children``): each rank's bytes (parameters, gradients, optimizer
  state, activations) *measured* by torch's memory trackers during one training step on
  a fake process group of the world size, the model built under ``FakeTensorMode``, the
  strategy applied by torch's own code (``parallelize``), mixed precision (``precision``)
  and activation checkpointing (``recompute``) as torch does them;
- ``flops``: the step's FLOPs counted by torch's ``FlopCounterMode``, attention included;
- ``compute``: FLOPs / (the device's peak × an efficiency you state);
- ``network``: what each collective costs by the α-β model (your ``ddplab.bench`` fit or a
  named interconnect), and torch's own guess beside it;
- ``strategies``: ddp, zero1, zero2, fsdp, tpT, ppP (ppPvV: interleaved) and their
  compositions, and what each sends; ``schedule``: the pipeline's micro-batches in flight
  and its bubble;
- ``step``: compute + exposed communication + the pipeline bubble;
- ``report``: ``Plan``: the table, the picture, the advice.

What it models: the bytes torch allocates for one step, the FLOPs torch counts,
collectives by α-β on rings, overlap by simple rules. What it does not: kernels one by
one (efficiency lumps them), the details of overlap (streams, bucket order), congestion
between groups that share links, the allocator's reserve and fragmentation, NCCL's own
buffers, Float8, torch.compile, context parallelism (see ``strategies``). It is a first
guess to check against a measurement: docs/plan.md compares it with published runs.

``ddplab.plan(...)`` is the function ``plan`` below: ``ddplab/__init__`` binds the name
``plan`` to it, and the steps stay importable as ``ddplab.plan.models`` and so on.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import ConfigError
from . import inputs
from .children import measure
from .compute import DEVICES, Device, device as named_device
from .models import CONFIGS, Config, named
from .network import INTERCONNECTS, Network
from .precision import RECIPES, Precision
from .report import Plan, Row
from .step import Step, step
from .strategies import Strategy, parse

__all__ = ["CONFIGS", "Config", "DEFAULT_STRATEGIES", "Device", "INTERCONNECTS", "Network", "Plan",
           "Precision", "RECIPES", "Row", "Step", "Strategy", "parse", "plan"]

DEFAULT_STRATEGIES = ("ddp", "zero1", "fsdp", "tp8+fsdp", "pp4+fsdp")


def plan(model: Any, world_sizes: Iterable[int] = (8, 64, 1024),
         strategies: Iterable[str] = DEFAULT_STRATEGIES, device: str | Device = "h100",
         network: str | Network | dict = "nvlink+ib", efficiency: float = 0.4,
         timeout: float = 600) -> Plan:
    """Memory per rank and step time of ``model`` for each strategy at each world size.

    ``model``: a ``Config``, a name in ``CONFIGS`` or a dict of Config's fields. ``device``:
    a name in ``compute.DEVICES``, ``"this-cpu"`` (measured here) or a ``Device``.
    ``network``: a name in ``INTERCONNECTS``, a ``Network``, or ``{"alpha", "beta"}`` as
    ``ddplab.bench.fit_ring`` returns. ``efficiency``: the share of the device's peak
    FLOP/s a step reaches, in (0, 1]. A strategy that cannot run at a size (tp8 on 4
    ranks) or that torch cannot trace there gets a row that says why. Every argument is
    checked before any tracing starts.
    """
    config = named(model)
    sizes, chosen = inputs.world_sizes(world_sizes), inputs.strategies(strategies)
    efficiency, timeout = inputs.efficiency(efficiency), inputs.timeout(timeout)
    if isinstance(device, str):
        device = named_device(device, efficiency, ranks_here=max(sizes))
    elif isinstance(device, Device):
        inputs.efficiency(device.efficiency)
    else:
        raise ConfigError(f"ddplab.plan: device is a name ({', '.join([*DEVICES, 'this-cpu'])}) or a "
                                 f"Device (from ddplab.plan import Device); got {device!r}.")
    if isinstance(network, dict):
        network = Network.from_bench(network)
    elif isinstance(network, str):
        network = Network.named(network)
    elif not isinstance(network, Network):
        inputs.alpha_beta(network)                 # refuses with what a network is
    cases, reasons = [], {}
    for n in sizes:
        for s in chosen:
            why = s.check(n, config)
            if why:
                reasons[(s.name, n)] = why
            else:
                cases.append((s.name, n))
    traced = measure(config, cases, timeout) if cases else {}
    rows = []
    for n in sizes:
        for s in chosen:
            key = (s.name, n)
            got = traced.get(key, {"error": reasons.get(key)})
            if got.get("error"):
                rows.append(Row(s.name, n, error=got["error"]))
                continue
            memory = {k: got["state"][k] for k in ("parameters", "gradients", "optimizer")}
            memory["activations"] = got["activations"]
            rows.append(Row(s.name, n, memory, got["peak"],
                            step(s, config, n, got["flops"], got["parameters"], device, network),
                            got["source"], tokens=s.replicas(n) * config.batch * config.seq,
                            model_states=got["model_states"], uncounted=got["uncounted"],
                            flops=got["flops"], parameters=got["parameters"]))
    return Plan(config, device, network, rows)
