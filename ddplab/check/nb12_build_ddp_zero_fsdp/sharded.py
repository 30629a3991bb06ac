"""Checkers for notebook 12, part 2: ZeRO-1 and FSDP built by hand.

    ddplab.check.zero1_adam(Zero1Adam)      # class Zero1Adam(params, lr) with .step()
    ddplab.check.fsdp_flat(shard_flat, gather_flat, reduce_scatter_flat)

``zero1_adam`` trains ``_steps64.model()`` with the student's optimizer for a
few Adam steps (the check averages the gradients first, as DDP would), and
compares the weights with one process's torch.optim.Adam on the whole batch in
float64 (1e-12); it also counts the bytes of Adam state the student's object
keeps on each rank, which must be one shard's, not the model's.
``fsdp_flat`` calls the three functions on known tensors (padding, which piece
each rank keeps, what comes back), then trains the model with them as FSDP
does (a ``FlatShardedLinear``: gather before forward, free, gather again for
backward, reduce_scatter the gradient) and compares with one process.
Using ZeroRedundancyOptimizer, fully_shard or DDP is refused. The tables show
expected values only for the check's own known tensors (1..n), never weights.
"""

from __future__ import annotations

from typing import Any

from .._core import checker, compare, passed, run_student_code, same
from .._feedback import Feedback
from .._forbid import refusing_library
from . import _steps64 as steps64

__all__ = ["fsdp_flat", "zero1_adam"]

_HANG = "every rank must make the same collective calls, in the same order, with tensors of one size."


def _padded_pieces(flat: Any, world: int) -> list[Any]:
    """``flat`` padded with zeros to a multiple of ``world``, cut into ``world`` equal pieces."""
    import torch

    size = -(-flat.numel() // world)
    return list(torch.cat([flat, flat.new_zeros(size * world - flat.numel())]).split(size))


# ------------------------------------------------------------------ ZeRO-1
def _state_bytes(optimizer: Any) -> int | None:
    """Bytes of Adam state (tensors with a dimension) in the torch optimizers ``optimizer`` keeps."""
    import torch

    inner = [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)]
    if isinstance(optimizer, torch.optim.Optimizer):
        inner.append(optimizer)
    if not inner:
        return None
    return sum(v.nbytes for opt in inner for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _train_zero1(cls: Any, rows: list) -> Any:
    """On a rank: train on ``rows`` with the student's Zero1Adam; the weights and the bytes of Adam state."""
    import torch.distributed as dist

    world = dist.get_world_size()
    net = steps64.model()
    with refusing_library(steps64.LIBRARY, "Zero1Adam", "ZeRO-1"):
        opt = cls(net.parameters(), lr=0.01)
        for x, y in rows:
            for p in net.parameters():
                p.grad = None
            steps64.loss(net, x, y).backward()
            for p in net.parameters():                 # what DDP leaves: averaged gradients
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
    return {"weights": steps64.flat(net), "state": _state_bytes(opt)}


ZERO_HINT = ("each rank keeps Adam (and its state) for one piece of the flattened parameters only, "
             "the pieces made equal by zero padding; a step gives the piece its part of the "
             "(already averaged) gradient and steps it, and then every rank needs every updated "
             "piece back in its parameters, without the padding.")


@checker
def zero1_adam(cls: Any, lab: Any = None) -> None:
    """Check ``Zero1Adam``: Adam state for this rank's shard only, the same weights as one process."""
    __tracebackhide__ = True
    import torch

    steps64.require_callables("ddplab.check.zero1_adam(Zero1Adam)", Zero1Adam=cls)
    world = lab.world_size
    batches = steps64.drawn(world)
    got = run_student_code("Zero1Adam(model.parameters(), lr=0.01) and its step()", _train_zero1,
                           cls, lab=lab, timeout=steps64.TIMEOUT, hint=_HANG,
                           each=steps64.each_rank(batches, world))
    got = [got[rank] for rank in range(world)]
    weights = [g["weights"] for g in got]
    if not all(isinstance(w, torch.Tensor) for w in weights):
        raise Feedback("Zero1Adam: the model's parameters did not come back as tensors.",
                       hint=ZERO_HINT)
    n = weights[0].numel()
    expected, initial = steps64.one_process("adam", batches), steps64.flat(steps64.model())
    if any(not torch.equal(weights[0], w) for w in weights[1:]):
        raise Feedback(
            f"Zero1Adam: after {steps64.STEPS} steps the ranks hold different weights: each rank "
            f"updated its own piece, but the updated pieces were not all_gathered, so a rank copied "
            f"back other values than the others.", hint=ZERO_HINT)
    for rank, w in enumerate(weights):
        still = 0                                  # values at the end that never moved
        while still < n and w[n - 1 - still] == initial[n - 1 - still]:
            still += 1
        if still and expected[n - 1] != initial[n - 1]:
            raise Feedback(
                f"Zero1Adam: on rank {rank} the last {still} of the {n} parameter values never "
                f"changed in {steps64.STEPS} steps: they belong to no rank's shard.",
                hint=f"{n} values do not split evenly over {world} ranks: pad the flat tensor with "
                     f"zeros to a multiple of world_size first, and leave the padding out when you "
                     f"copy back.")
    steps64.verdict("Zero1Adam", "adam", weights, ZERO_HINT, batches)
    shard = 8 * 2 * -(-n // world)                     # exp_avg and exp_avg_sq, float64
    if any(g["state"] is None for g in got):
        raise Feedback("Zero1Adam: the weights are right, but the check finds no "
                       "torch.optim.Adam among your object's attributes to count its state.",
                       hint="keep the Adam that steps this rank's shard as an attribute, e.g. "
                            "self.adam.")
    for rank, g in enumerate(got):
        if g["state"] > shard:
            raise Feedback(
                f"Zero1Adam: rank {rank} keeps {g['state']} bytes of Adam state, but one shard's is "
                f"{shard} bytes (two float64 values for each of ceil({n} / {world}) parameters): "
                f"it keeps state for more than its own shard.", hint=ZERO_HINT)
    passed(f"Zero1Adam: each rank keeps Adam state for its shard only ({shard} bytes), and after "
           f"{steps64.STEPS} steps every rank holds one process's weights (float64, "
           f"{steps64.TOLERANCE:g}).")


# ------------------------------------------------------------------ FSDP
def _flat_sharded_linear() -> Any:
    import torch

    class FlatShardedLinear(torch.autograd.Function):
        """A Linear whose weight and bias live as one flat shard per rank, gathered only while used.

        ``FlatShardedLinear.apply(x, shard, out_features, in_features, gather, reduce_scatter)``:
        forward gathers the whole flat parameter, computes ``x @ W.T + b`` and lets the gathered
        tensor go; backward gathers it again, computes the gradients, and returns for ``shard``
        ``reduce_scatter(the whole flat gradient)``.
        """

        @staticmethod
        def forward(ctx, x, shard, out_features, in_features, gather, reduce_scatter):
            ctx.save_for_backward(x, shard)                 # not the gathered weight: it is freed
            ctx.layer = (out_features, in_features, gather, reduce_scatter)
            full = gather(shard.detach(), out_features * in_features + out_features)
            weight = full[:out_features * in_features].view(out_features, in_features)
            return x @ weight.T + full[out_features * in_features:]

        @staticmethod
        def backward(ctx, grad_out):
            x, shard = ctx.saved_tensors
            out_features, in_features, gather, reduce_scatter = ctx.layer
            full = gather(shard.detach(), out_features * in_features + out_features)   # again
            weight = full[:out_features * in_features].view(out_features, in_features)
            grad_full = torch.cat([(grad_out.T @ x).reshape(-1), grad_out.sum(0)])
            return grad_out @ weight, reduce_scatter(grad_full), None, None, None, None

    return FlatShardedLinear


def _fsdp_units(fns: tuple, n: int) -> Any:
    """On a rank: the student's three functions on known tensors of ``n`` values."""
    import torch
    import torch.distributed as dist

    shard_flat, gather_flat, reduce_scatter_flat = fns
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.arange(1, n + 1, dtype=torch.float64)
    with refusing_library(steps64.LIBRARY, "shard_flat / gather_flat / reduce_scatter_flat", "FSDP"):
        shard = shard_flat(values.clone())
        gathered = gather_flat(_padded_pieces(values, world)[rank].clone(), n)
        reduced = reduce_scatter_flat(values * (rank + 1))
    return {"shard": shard, "gathered": gathered, "reduced": reduced}


def _train_fsdp(fns: tuple, rows: list) -> Any:
    """On a rank: train the model as FlatShardedLinear units with the student's functions."""
    import torch
    import torch.distributed as dist

    shard_flat, gather_flat, reduce_scatter_flat = fns
    unit = _flat_sharded_linear()
    world = dist.get_world_size()
    linears = [m for m in steps64.model() if isinstance(m, torch.nn.Linear)]
    with refusing_library(steps64.LIBRARY, "shard_flat / gather_flat / reduce_scatter_flat", "FSDP"):
        shards = [shard_flat(torch.cat([m.weight.detach().reshape(-1), m.bias.detach()]))
                  .detach().clone().requires_grad_() for m in linears]
        opt = steps64.optimizer("sgd", shards)
        for h, y in rows:
            opt.zero_grad()
            for i, m in enumerate(linears):
                h = unit.apply(h, shards[i], m.out_features, m.in_features, gather_flat,
                               reduce_scatter_flat)
                h = torch.tanh(h) if i < len(linears) - 1 else h
            torch.nn.functional.mse_loss(h, y).backward()
            opt.step()
    whole = []
    for shard, m in zip(shards, linears):                 # the check's own all_gather
        pieces = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(pieces, shard.detach())
        whole.append(torch.cat(pieces)[:m.weight.numel() + m.bias.numel()])
    return {"weights": torch.cat(whole)}


FSDP_HINT = ("every rank's piece is the same size (the flat tensor padded with zeros), and rank r "
             "keeps piece r; gathering puts the pieces back together without the padding; "
             "reduce-scattering gives rank r everyone's piece r summed, averaged once.")


@checker
def fsdp_flat(shard_flat: Any, gather_flat: Any, reduce_scatter_flat: Any, lab: Any = None) -> None:
    """Check ``shard_flat``, ``gather_flat`` and ``reduce_scatter_flat``, then train with them."""
    __tracebackhide__ = True
    import torch

    fns = (shard_flat, gather_flat, reduce_scatter_flat)
    steps64.require_callables("ddplab.check.fsdp_flat(shard_flat, gather_flat, reduce_scatter_flat)",
                              shard_flat=shard_flat, gather_flat=gather_flat,
                              reduce_scatter_flat=reduce_scatter_flat)
    world = lab.world_size
    for n in (7, 213):
        got = run_student_code(f"shard_flat / gather_flat / reduce_scatter_flat on {n} values",
                               _fsdp_units, fns, n, lab=lab, timeout=steps64.TIMEOUT, hint=_HANG)
        values = torch.arange(1, n + 1, dtype=torch.float64)
        pieces = _padded_pieces(values, world)
        size = pieces[0].numel()
        shards = [g["shard"] for g in got]
        counts = [s.numel() if hasattr(s, "numel") else repr(s) for s in shards]
        if counts != [size] * world:
            raise Feedback(
                f"shard_flat on {n} values over {world} ranks gave pieces of {counts} values: "
                f"every rank's piece must be the same size, ceil({n} / {world}) = {size}, so the "
                f"flat tensor must be padded with zeros first.", hint=FSDP_HINT)
        compare(f"shard_flat(1..{n}): this rank's piece", pieces, shards, hint=FSDP_HINT)
        gathered = [g["gathered"] for g in got]
        if any(hasattr(t, "numel") and t.numel() == size * world != n for t in gathered):
            raise Feedback(f"gather_flat(shard, {n}) gave {size * world} values, not {n}: the "
                           f"padding was left in.", hint=FSDP_HINT)
        compare(f"gather_flat(this rank's piece of 1..{n}, {n})", [values] * world, gathered,
                hint=FSDP_HINT)
        mean = sum(range(1, world + 1)) / world
        reduced = [g["reduced"] for g in got]
        for factor, mistake in ((world, "summed but never divided by world_size"),
                                (1 / world, "averaged twice (divided by world_size twice)")):
            wrong = _padded_pieces(values * mean * factor, world)
            if all(same(w, r, atol=1e-12) for w, r in zip(wrong, reduced)):
                raise Feedback(f"reduce_scatter_flat: the gradients were {mistake}.",
                               hint=FSDP_HINT)
        compare(f"reduce_scatter_flat(1..{n} times (rank + 1)): the mean, this rank's piece",
                _padded_pieces(values * mean, world), reduced, atol=1e-12, hint=FSDP_HINT)
    batches = steps64.drawn(world)
    got = run_student_code("training with FlatShardedLinear and your three functions", _train_fsdp,
                           fns, lab=lab, timeout=steps64.TIMEOUT, hint=_HANG,
                           each=steps64.each_rank(batches, world))
    got = [got[rank] for rank in range(world)]
    steps64.verdict("fsdp_flat", "sgd", [g["weights"] for g in got], FSDP_HINT, batches)
    passed(f"shard_flat, gather_flat and reduce_scatter_flat: padded pieces, gathered without the "
           f"padding, gradients averaged once; {steps64.STEPS} FSDP steps give one process's weights "
           f"(float64, {steps64.TOLERANCE:g}).")

