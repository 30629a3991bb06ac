"""Plan a training run before you have the machines: memory per rank and step time, per strategy.

    p = ddplab.plan("llm-1b", world_sizes=[8, 64, 1024],
                    strategies=["ddp", "zero1", "fsdp", "tp8+fsdp", "pp4+fsdp"],
                    device="h100", network="nvlink+ib")
    p                       # the table: memory split, step time split, what fits
    p.picture()             # the same as bars
    p.advice()              # "64 ranks: does not fit in 80 GB: ddp. fastest that fits: fsdp ..."

    python -m ddplab.plan llm-1b --world-sizes 8 64 1024 --device h100

    net = ddplab.plan.Network.from_bench(ddplab.bench.fit_ring(results))   # your lab's α and β
    ddplab.plan("toy", [2, 4], ["ddp", "fsdp"], device="this-cpu", network=net)

The steps, one module each (the order a plan is made in):

- ``models``: ``Config``, the model as a config (``CONFIGS``: toy, toy-wide, gpt-tiny, llm-1b, llm-8b);
- ``memory``: each rank's bytes (parameters, gradients, optimizer state, activations) and
  FLOPs, *measured* by torch's memory trackers and flop counter on a fake process group of
  the world size, the model built under ``FakeTensorMode``, in a child process;
- ``compute``: FLOPs / (the device's peak × an efficiency you state);
- ``network``: what each collective costs by the α-β model (your ``ddplab.bench`` fit or a
  named interconnect), and torch's own guess beside it;
- ``strategies``: ddp, zero1, fsdp, tpT, ppP and their compositions, and what each sends;
- ``step``: compute + exposed communication + the pipeline bubble;
- ``report``: ``Plan``: the table, the picture, the advice.

What it models: the bytes torch allocates for one step, the FLOPs torch counts, collectives
by α-β on rings, overlap by simple rules. What it does not: kernels one by one (efficiency
lumps them), the details of overlap (streams, bucket order), congestion between groups that
share links, allocator fragmentation, NCCL's own buffers. It is a first guess to check
against a measurement, which is what benchmarks/bench_plan.py does on this machine.

``ddplab.plan`` is this package and can also be called: ``ddplab.plan(...)`` is ``plan(...)``.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Iterable

from .compute import Device, device as named_device
from .memory import measure
from .models import CONFIGS, Config, named
from .network import INTERCONNECTS, Network
from .report import Plan, Row
from .step import Step, step
from .strategies import Strategy, parse

__all__ = ["CONFIGS", "Config", "Device", "INTERCONNECTS", "Network", "Plan", "Row", "Step",
           "Strategy", "parse", "plan"]

DEFAULT_STRATEGIES = ("ddp", "zero1", "fsdp", "tp8+fsdp", "pp4+fsdp")


def plan(model: Any, world_sizes: Iterable[int] = (8, 64, 1024),
         strategies: Iterable[str] = DEFAULT_STRATEGIES, device: str | Device = "h100",
         network: str | Network | dict = "nvlink+ib", efficiency: float = 0.4,
         timeout: float = 600) -> Plan:
    """Memory per rank and step time of ``model`` for each strategy at each world size.

    ``model``: a ``Config``, a name in ``CONFIGS`` or a dict of Config's fields. ``device``:
    a name in ``compute.DEVICES``, ``"this-cpu"`` (measured here) or a ``Device``.
    ``network``: a name in ``INTERCONNECTS``, a ``Network``, or ``{"alpha", "beta"}`` as
    ``ddplab.bench.fit_ring`` returns. A strategy that cannot run at a size (tp8 on 4
    ranks) or that torch cannot trace there gets a row that says why.
    """
    config = named(model)
    world_sizes, chosen = list(world_sizes), [parse(s) for s in strategies]
    if isinstance(device, str):
        device = named_device(device, efficiency, ranks_here=max(world_sizes))
    if isinstance(network, dict):
        network = Network.from_bench(network)
    elif isinstance(network, str):
        network = Network.named(network)
    heads = config.d_model // config.head_dim if config.kind != "mlp" else 4 * config.d_model
    cases, reasons = [], {}
    for n in world_sizes:
        for s in chosen:
            why = s.check(n, config.layers, heads)
            if why:
                reasons[(s.name, n)] = why
            else:
                cases.append((s.name, n))
    traced = measure(config, cases, timeout) if cases else {}
    rows = []
    for n in world_sizes:
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
                            got["source"], tokens=s.replicas(n) * config.batch * config.seq))
    return Plan(config, device, network, rows)


class _CallablePackage(types.ModuleType):
    """``ddplab.plan`` the package, callable as ``ddplab.plan(...)``: the teaching API names
    the function, and the package keeps its steps as modules a reader can open."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
