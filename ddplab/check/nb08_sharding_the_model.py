"""Checkers for notebook 08, sharding the model (ZeRO, FSDP2, tensor parallelism).

- ``zero_bytes(fn)``: ``fn(n_params, world_size, stage)`` gives the bytes one
  rank keeps for parameters, gradients and Adam's state in float32, for DDP
  (stage 0) and ZeRO stages 1, 2 and 3, sharded evenly.
- ``shard_model()``: the variable ``model`` on each rank is notebook 08's MLP
  (``ddplab.sharding.mlp(seed=0)``) sharded with ``fully_shard``: every Linear
  its own FSDP unit, and the root too; every parameter a DTensor of which this
  rank holds 1/N of the rows; the full weights still seed 0's; its output that
  of the unsharded model.
- ``column_parallel(fn)``: ``fn(x, weight_shard, bias_shard)`` with this
  rank's rows of a Linear's weight and bias returns the full output on every
  rank (an all_gather of the output columns).
- ``row_parallel(fn)``: ``fn(x_shard, weight_shard, bias)`` with this rank's
  input columns and weight columns returns the full output on every rank (an
  all_reduce of partial sums; the bias added once).

The expected answers are computed independently of the student's code: the
byte counts from the stage definitions, the layers' outputs by
``torch.nn.functional.linear`` on the whole weight, here in the checker. The
layers are drawn for each check from a seed no rank sees, and each rank is
sent only its shards (``Lab.run_each``): the whole weight a rank can know only
by communicating. The tables show expected values: a function's results for
the check's own cases, or facts of the sharded model, never a value to copy.
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import (
    MISSING,
    answers_of,
    checker,
    compare,
    holds,
    is_missing,
    passed,
    require_function,
    run_student_code,
    student_raised,
)
from ._feedback import Feedback, Row

__all__ = ["column_parallel", "row_parallel", "shard_model", "zero_bytes"]

_TIMEOUT = 60.0
_HINT = "every rank must make the same collective calls, in the same order."


def _on_ranks(what: str, lab: Any, fn: Callable, *args: Any) -> list[Any]:
    """Run ``fn`` on every rank; a student's exception or deadlock becomes a ``Feedback``."""
    return run_student_code(what, fn, *args, lab=lab, timeout=_TIMEOUT, hint=_HINT)


# ----------------------------------------------------------------- zero_bytes
def _stage_bytes(n_params: int, world_size: int, stage: int) -> dict[str, int]:
    """What one rank keeps, float32 Adam (two state values per parameter), sharded evenly."""
    full, shard = 4 * n_params, 4 * n_params // world_size
    return {"parameters": shard if stage >= 3 else full,
            "gradients": shard if stage >= 2 else full,
            "optimizer": 2 * (shard if stage >= 1 else full)}


@checker(needs_lab=False)
def zero_bytes(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(n_params, world_size, stage)``: per-rank bytes of DDP (stage 0) and ZeRO 1, 2, 3.

    ``fn`` runs on rank 0 of the running lab (``answers_of``), or here if none runs.
    """
    __tracebackhide__ = True
    if not callable(fn):
        raise Feedback(f"ddplab.check.zero_bytes needs your function; got {fn!r}.",
                       hint="pass it, as in ddplab.check.zero_bytes(zero_bytes).")
    hints = {0: "stage 0 is DDP: every rank keeps everything, Adam's two values per parameter too.",
             1: "stage 1 shards only the optimizer state: parameters and gradients stay whole.",
             2: "stage 2 shards the optimizer state and the gradients, not the parameters.",
             3: "stage 3 (FSDP) shards all three: each rank keeps 1/world_size of each."}
    cases = [(n_params, world_size, stage)
             for n_params, world_size in [(26_122 * 4, 2), (1_000_000, 4), (1_000_000, 8)]
             for stage in range(4)]
    for (n_params, world_size, stage), answer in zip(cases, answers_of(fn, cases, lab)):
        expected = _stage_bytes(n_params, world_size, stage)
        if answer[0] != "ok":
            raise student_raised(f"zero_bytes({n_params}, {world_size}, {stage})", answer)
        got = answer[1]
        if isinstance(got, dict):
            got = {key: int(value) if isinstance(value, float) and value.is_integer() else value
                   for key, value in got.items()}
        if got != expected:
            raise Feedback(f"zero_bytes({n_params}, {world_size}, stage={stage}) is wrong.",
                           rows=[Row("zero_bytes", repr(got), repr(expected), True)],
                           hint=f"a dict with keys 'parameters', 'gradients', 'optimizer', each in "
                                f"bytes (float32: 4 bytes a value). {hints[stage]}")
    passed("zero_bytes gives what each rank keeps under DDP and ZeRO stages 1, 2 and 3.")


# ---------------------------------------------------------------- shard_model
def _rows_of_rank(shape: Any, rank: int, world: int) -> int:
    """Values of a parameter of ``shape`` that are rank's when dim 0 is split as torch.chunk does."""
    import math

    rows = -(-shape[0] // world)                       # ceil: the last ranks may get fewer, or none
    mine = max(0, min(rows, shape[0] - rank * rows))
    return mine * math.prod(shape[1:])


def _describe_sharded(seed: int, rows: int) -> Any:
    """On a rank: how ``model`` is sharded, whether its full weights are seed's, and its output."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.rank.engine import namespace
    from ddplab.sharding import mlp

    model = namespace().get("model", MISSING)
    if is_missing(model):
        return MISSING
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    out = {"linears": len(linears),
           "units": sum(isinstance(m, FSDPModule) for m in linears),
           "root": isinstance(model, FSDPModule),
           "all_dtensors": len(dtensors) == len(params) and bool(params),
           "placements": sorted({str(p.placements) for p in dtensors}),
           "mesh": sorted({p.device_mesh.size() for p in dtensors}),
           "local": sum(p.to_local().numel() for p in dtensors),
           "share": sum(_rows_of_rank(p.shape, dist.get_rank(), world) for p in params)}
    if not out["all_dtensors"] or out["placements"] != [str((Shard(0),))] or out["mesh"] != [world]:
        return out
    reference = mlp(seed=seed)
    full = [p.detach().full_tensor() for p in model.parameters()]
    out["seed_weights"] = all(torch.equal(f.to(r.dtype), r.detach())
                              for f, r in zip(full, reference.parameters()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + dist.get_rank())
        x = torch.rand(rows, 1, 8, 8)
    dtype = full[0].dtype
    with torch.no_grad():
        y = model(x.to(dtype))
        y = y.full_tensor() if isinstance(y, DTensor) else y
        ref = {name: f for name, f in zip([n for n, _ in reference.named_parameters()], full)}
        reference.load_state_dict(ref)
        expected = reference.to(dtype)(x.to(dtype))
    out["same_output"] = bool(torch.allclose(y, expected, atol=1e-5, rtol=1e-4))
    out["resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


@checker
def shard_model(lab: Any = None, seed: int = 0) -> None:
    """Check ``model``: the MLP with every Linear and the root under ``fully_shard``, 1/N per rank."""
    __tracebackhide__ = True
    n = lab.world_size
    got = _on_ranks("the sharded `model`", lab, _describe_sharded, seed, 4)
    require_function(got, "model", kind="variable", verb="makes")
    holds("every parameter of model is a DTensor", [g["all_dtensors"] for g in got],
          hint="fully_shard turns the parameters of the module it is called on into DTensors: "
               "every Linear, then model itself.")
    compare("the placements of model's parameters", [[str("(Shard(dim=0),)")]] * n,
            [g["placements"] for g in got],
            hint="fully_shard shards dim 0 on a 1-D device mesh of all ranks.")
    compare("the ranks in the parameters' mesh", [[n]] * n, [g["mesh"] for g in got],
            hint="the mesh must hold every rank: a 1-D device mesh of world_size.")
    compare("Linear layers that are their own fully_shard unit", [got[0]["linears"]] * n,
            [g["units"] for g in got],
            hint="call fully_shard on each Linear first (each becomes a unit that is gathered "
                 "only while it runs), then on the root.")
    holds("model itself is a fully_shard unit (the root)", [g["root"] for g in got],
          hint="after the layers, the whole model is sharded too.")
    compare("parameter values this rank holds", [g["share"] for g in got], [g["local"] for g in got],
            hint="each rank should keep 1/world_size of every parameter.")
    holds("the full weights equal mlp(seed=0)'s", [g["seed_weights"] for g in got],
          hint="fully_shard does not broadcast weights as DDP does: each rank keeps its own rows. "
               "Build the model from the same seed on every rank: sharding.mlp(seed=0).")
    holds("model(x) equals the unsharded model's output", [g["same_output"] for g in got],
          hint="shard the model as it is; do not change its layers.")
    holds("the parameters are resharded after forward (DTensors again)",
          [g["resharded"] for g in got], hint="leave reshard_after_forward at its default (True).")
    passed("model is sharded layer by layer with fully_shard; each rank holds 1/N of every "
           "parameter, and it computes what the unsharded model computes.")


# ---------------------------------------------------------- tensor parallelism
def _layer(out_features: int, in_features: int, seed: int) -> tuple[Any, Any, Any]:
    """A Linear's full weight, bias and an input batch (float64), made by the checker from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g, dtype=torch.float64)
    bias = torch.randn(out_features, generator=g, dtype=torch.float64)
    x = torch.randn(3, in_features, generator=g, dtype=torch.float64)
    return weight, bias, x


def _shards(kind: str, rank: int, world: int, weight: Any, bias: Any, x: Any) -> tuple[Any, Any, Any]:
    """What rank ``rank`` is given: ``(x, weight_shard, bias_shard)`` or ``(x_shard, weight_shard, bias)``."""
    if kind == "column":      # this rank's output features: rows of the weight, entries of the bias
        return x.clone(), weight.chunk(world, dim=0)[rank].clone(), bias.chunk(world)[rank].clone()
    # this rank's input features: columns of x and of the weight
    return x.chunk(world, dim=1)[rank].clone(), weight.chunk(world, dim=1)[rank].clone(), bias.clone()


def _call_parallel(student: Callable, *given: Any) -> Any:
    """On a rank: call the student's layer with this rank's shards, sent to it alone; what it gave."""
    import torch

    y = student(*given)
    if hasattr(y, "full_tensor"):
        y = y.full_tensor()
    return y.detach().clone() if isinstance(y, torch.Tensor) else y


def _check_parallel(name: str, fn: Callable, kind: str, lab: Any, hint: str) -> None:
    __tracebackhide__ = True
    import secrets

    import torch.nn.functional as F

    if not callable(fn):
        raise Feedback(f"ddplab.check.{name} needs your function; got {fn!r}.",
                       hint=f"pass it, as in ddplab.check.{name}({name}).")
    n = lab.world_size
    args = "x, weight_shard, bias_shard" if kind == "column" else "x_shard, weight_shard, bias"
    for out_features, in_features in [(4 * n, 2 * n), (2 * n, 4 * n), (n, 2 * n)]:
        # Drawn now, from a seed no rank sees; each rank is sent only its shards (Lab.run_each).
        weight, bias, x = _layer(out_features, in_features, secrets.randbits(40))
        got = run_student_code(f"{name}({args})", _call_parallel, fn, lab=lab, timeout=_TIMEOUT,
                               hint=_HINT, each={rank: _shards(kind, rank, n, weight, bias, x)
                                                 for rank in range(n)})
        got = [got[rank] for rank in range(n)]
        expected = F.linear(x, weight, bias)
        compare(f"{name}({args}) of a Linear({in_features}, {out_features}) on a batch of 3",
                [expected] * n, got, atol=1e-9, hint=hint)


@checker
def column_parallel(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(x, weight_shard, bias_shard)``: local rows of the output, then all_gather them."""
    __tracebackhide__ = True
    _check_parallel("column_parallel", fn, "column", lab,
                    "each rank computes its own output features from its rows of the weight and "
                    "its entries of the bias; the full output is every rank's features side by "
                    "side along the last dimension, in rank order.")
    passed("column_parallel computes its share of the output features and all_gathers the rest.")


@checker
def row_parallel(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(x_shard, weight_shard, bias)``: partial sums, one all_reduce, the bias once."""
    __tracebackhide__ = True
    _check_parallel("row_parallel", fn, "row", lab,
                    "each rank's product is a partial sum over its own input features; the output "
                    "is the sum of them, with the bias added once (added before the sum, every "
                    "rank's copy of it is summed too).")
    passed("row_parallel sums the ranks' partial products with one all_reduce and adds the "
           "bias once.")
