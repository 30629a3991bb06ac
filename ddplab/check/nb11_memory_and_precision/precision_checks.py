"""Checkers for notebook 11, memory and precision.

- ``checkpoint_blocks()``: ``ckpt_forward(model, x)`` runs a
  ``ddplab.memory.deep_mlp`` with every block (``model[1:-1]``) under
  ``torch.utils.checkpoint.checkpoint``: the output and gradients of the plain
  model, and autograd saves exactly what per-block checkpointing saves.
- ``mixed_step()``: ``mixed_step(model, optimizer, x, y)`` takes one step with
  the forward and the loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``
  while the weights, their gradients and the update stay float32 (the master
  weights).
- ``bf16_hook()``: ``bf16_hook(state, bucket)``, a DDP communication hook,
  all_reduces the gradients in bfloat16 (half the bytes of float32, measured on
  the timeline) and leaves the mean gradient, to bfloat16's precision.
- ``accumulate()``: ``accumulate(ddp, optimizer, batches)`` takes one step over
  several micro-batches with ``ddp.no_sync()`` for all but the last: one round
  of gradient all_reduces (counted on the timeline), and the weights of one
  step on the whole batch; a wrong step is named by the ratio of its update to
  the expected one (4x: summed over the micro-batches without dividing).

The expected answers come from torch itself, never from stored numbers:
``mixed_step``'s autocast step in the checker's process (the weights and the
loss come back from the ranks: nothing on a rank holds the answer), the
others' on the same ranks (the plain model, a float32 all_reduce, one big batch).
"""

from __future__ import annotations

from typing import Any, Callable

from .._core import checker, compare, holds, passed, run_student_code, run_student_function

__all__ = ["accumulate", "bf16_hook", "checkpoint_blocks", "mixed_step"]

_TIMEOUT = 60.0


def _student(name: str, lab: Any, fn: Callable, *args: Any) -> list[Any]:
    """Run ``fn(student_function, *args)`` on every rank; every failure becomes a ``Feedback``."""
    return run_student_function(name, fn, *args, lab=lab, timeout=_TIMEOUT,
                                hint="every rank must make the same collective "
                                     "calls, in the same order.")


def _weights(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().flatten() for p in getattr(model, "module", model).parameters()])


# ------------------------------------------------------------ checkpoint_blocks
def _checkpoint_answers(student: Callable) -> dict:
    """On a rank: the student's forward against the plain one and torch's per-block checkpointing."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from ddplab.memory import deep_mlp, saved_bytes

    out: dict[str, Any] = {}
    for depth in (2, 3):
        model = deep_mlp(depth=depth, width=16, seed=depth, dtype=torch.float64)
        x = torch.rand(5, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(depth))

        def reference(model=model, x=x):
            h = model[0](x)
            for block in model[1:-1]:
                h = checkpoint(block, h, use_reentrant=False)
            return model[-1](h).sum()

        plain = saved_bytes(lambda m=model, x=x: m(x).sum(), model)
        expected = saved_bytes(reference, model)
        got = saved_bytes(lambda m=model, x=x: student(m, x).sum(), model)
        model.zero_grad()
        model(x).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        y = student(model, x)
        same_output = isinstance(y, torch.Tensor) and y.shape == (5, 10) and bool(
            torch.allclose(y, model(x), atol=1e-12, rtol=0))
        same_grads = False
        if same_output and y.requires_grad:
            y.sum().backward()
            same_grads = all(p.grad is not None and torch.allclose(p.grad, g, atol=1e-12, rtol=0)
                             for p, g in zip(model.parameters(), grads))
        out[depth] = {"plain": plain, "expected": expected, "got": got,
                      "output": same_output, "grads": same_grads}
    return out


@checker
def checkpoint_blocks(lab: Any = None) -> None:
    """Check ``ckpt_forward(model, x)``: every block of a deep_mlp checkpointed, nothing else changed."""
    __tracebackhide__ = True
    got = _student("ckpt_forward", lab, _checkpoint_answers)
    for depth in (2, 3):
        rows = [g[depth] for g in got]
        holds(f"ckpt_forward(model, x) equals model(x) (deep_mlp(depth={depth}))",
              [r["output"] for r in rows],
              hint="run model[0], then each block of model[1:-1], then model[-1], in order, and "
                   "return the output (batch x 10).")
        holds(f"the gradients after ckpt_forward(model, x).sum().backward() are model(x)'s "
              f"(depth={depth})", [r["grads"] for r in rows],
              hint="the output must still be part of the autograd graph: no torch.no_grad(), no "
                   ".detach(); checkpointing recomputes the block in backward.")
        kept = [r["got"] for r in rows]
        if kept == [r["plain"] for r in rows]:
            hint = ("autograd saved as much as without checkpointing: each block must run through "
                    "torch.utils.checkpoint (use_reentrant=False), which keeps only its input.")
        elif all(k < r["expected"] for k, r in zip(kept, rows)):
            hint = ("you saved even less than per-block checkpointing: checkpoint each block of "
                    "model[1:-1] on its own, not several blocks (or the whole model) in one call.")
        else:
            hint = "checkpoint every block of model[1:-1], each in its own checkpoint call."
        compare(f"bytes autograd saves for backward (depth={depth})", [r["expected"] for r in rows],
                kept, hint=hint)
    passed("each block is recomputed in backward: the same output and gradients, and only the "
           "blocks' inputs saved.")


# ------------------------------------------------------------------ mixed_step
#: The batch mixed_step is given: 16 digits from sample 48 on.
_MIXED_BATCH = (16, 48)


def _mixed_answers(student: Callable) -> dict:
    """On a rank: one student step on an fp32 mlp, and what ran in bf16.

    Nothing here knows what the step should give: the weights and the loss go
    back to the checker, which takes torch's autocast step itself (``_mixed_reference``).
    """
    import torch
    from torch import nn

    from ddplab.sharding import digits_batch, mlp

    x, y = digits_batch(_MIXED_BATCH[0], start=_MIXED_BATCH[1], dtype=torch.float32)
    model = mlp(seed=1)
    before = _weights(model).clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dtypes: list[str] = []
    hooks = [m.register_forward_hook(lambda m, i, o: dtypes.append(str(o.dtype).replace("torch.", "")))
             for m in model.modules() if isinstance(m, nn.Linear)]
    result = student(model, optimizer, x, y)
    for hook in hooks:
        hook.remove()
    params = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    grads = sorted({str(p.grad.dtype).replace("torch.", "") for p in model.parameters()
                    if p.grad is not None})
    after = _weights(model).float()
    return {"linear": sorted(set(dtypes)), "params": params, "grads": grads,
            "stepped": bool(not torch.equal(after, before)), "weights": after.clone(),
            "result": result if isinstance(result, float) else None}


def _mixed_reference() -> tuple[Any, float]:
    """In the checker: torch's autocast step on the same mlp and batch: the weights, the loss."""
    import torch
    import torch.nn.functional as F

    from ddplab.sharding import digits_batch, mlp

    x, y = digits_batch(_MIXED_BATCH[0], start=_MIXED_BATCH[1], dtype=torch.float32)
    reference = mlp(seed=1)                            # leaves the notebook's random stream alone
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(reference(x), y)
    loss.backward()
    sgd.step()
    return _weights(reference), loss.item()


@checker
def mixed_step(lab: Any = None) -> None:
    """Check ``mixed_step(model, optimizer, x, y)``: autocast bf16 forward, fp32 master weights."""
    __tracebackhide__ = True
    import torch

    got = _student("mixed_step", lab, _mixed_answers)
    n = lab.world_size
    weights, loss = _mixed_reference()
    for g in got:
        g["close"] = bool(g["weights"].shape == weights.shape
                          and torch.allclose(g["weights"], weights, atol=1e-5, rtol=0))
        g["loss"] = g["result"] is not None and abs(g["result"] - loss) < 1e-2
    compare("the dtype of the model's parameters after mixed_step (the master weights)",
            [["float32"]] * n, [g["params"] for g in got],
            hint="keep the model in float32: do not call model.to(torch.bfloat16) / .bfloat16(). "
                 "autocast casts to bfloat16 per operation; the weights themselves stay float32.")
    compare("the dtype of the Linear layers' outputs in mixed_step's forward", [["bfloat16"]] * n,
            [g["linear"] for g in got],
            hint="run the forward pass and the loss under autocast to bfloat16 on the CPU: it "
                 "casts per operation, and the Linear layers then compute in bfloat16.")
    compare("the dtype of the gradients", [["float32"]] * n, [g["grads"] for g in got],
            hint="call loss.backward(): the gradients of float32 weights are float32.")
    holds("the step changed the weights", [g["stepped"] for g in got],
          hint="zero the gradients, backward, then optimizer.step().")
    holds("the weights equal torch's autocast step (to 1e-5)", [g["close"] for g in got],
          hint="one step: the forward and the loss under autocast; backward and the optimizer's "
               "step after it, outside.")
    holds("mixed_step returns the loss as a Python float", [g["loss"] for g in got],
          hint="return the loss's value (.item()), not the tensor.")
    passed("the forward ran in bfloat16 under autocast, while the weights, gradients and update "
           "stayed float32.")


# ------------------------------------------------------------------- bf16_hook
def _hook_answers(student: Callable, register: bool) -> dict:
    """On a rank: DDP gradients with the student's hook, against float32 DDP's."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sharding import digits_batch, mlp

    rank = dist.get_rank()
    x, y = digits_batch(16, start=16 * rank, dtype=torch.float32)
    from ddplab.check._forbid import refusing_library

    ddp = DDP(mlp(seed=2))
    if register:
        ddp.register_comm_hook(None, student)
    # torch's own hooks, under any name, are what the exercise asks to write
    with refusing_library(("torch's compression hooks",), "bf16_hook", builds="a bfloat16 compression hook"):
        F.cross_entropy(ddp(x), y).backward()
    grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    nbytes = sum(p.grad.nbytes for p in ddp.parameters())
    return {"grads": grads, "nbytes": nbytes}


def _collective_bytes(trace: Any, rank: int) -> list[tuple[str, int]]:
    return [(e.op, e.nbytes) for e in trace.events
            if e.rank == rank and e.kind == "collective" and e.op.startswith(("all_reduce", "reduce"))]


@checker
def bf16_hook(lab: Any = None) -> None:
    """Check ``bf16_hook(state, bucket)``: the buckets all_reduced in bfloat16, the mean gradient kept."""
    __tracebackhide__ = True
    import torch

    n = lab.world_size
    plain = run_student_code("DDP without a hook", _hook_answers, None, False, lab=lab,
                             timeout=_TIMEOUT, hint="")
    with lab.trace() as trace:
        got = _student("bf16_hook", lab, _hook_answers, True)
    full = got[0]["nbytes"]
    moved = [sum(b for _, b in _collective_bytes(trace, rank)) for rank in range(n)]
    compare("bytes all_reduced per rank by the hook (float32 gradients: "
            f"{full:,} bytes)", [full // 2] * n, moved,
            hint=("the hook must all_reduce a bfloat16 copy of the bucket's buffer: 2 bytes a "
                  "value, half of float32's 4." if moved[0] != 0 else
                  "the hook must all_reduce the bucket itself, asynchronously, and return the "
                  "future of that all_reduce."))
    errors = [(g["grads"] - p["grads"]).abs().max().item() / p["grads"].abs().max().item()
              for g, p in zip(got, plain)]
    summed = [bool(torch.allclose(g["grads"], n * p["grads"], rtol=1e-2, atol=1e-4))
              for g, p in zip(got, plain)]
    if n > 1 and all(summed):
        hint = f"the gradients are the sum over the ranks, not the mean: divide by the world size ({n})."
    else:
        hint = ("decompress into the bucket: copy the all_reduced bfloat16 values back into "
                "bucket.buffer() and return that (float32) tensor from the future's then().")
    holds("the gradients are within bfloat16's precision (relative error < 1e-2) of float32 DDP's",
          [e < 1e-2 for e in errors], hint=hint)
    passed("the hook all_reduces each bucket in bfloat16, half the bytes, and DDP gets the mean "
           "gradient back to bfloat16's precision.")


# ------------------------------------------------------------------ accumulate
#: Micro-batches per step and samples per micro-batch in the accumulate check.
MICRO, MICRO_SIZE = 4, 6


def _accumulate_run(student: Callable | None) -> dict:
    """On a rank: one step over MICRO micro-batches (student) or one backward (reference)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sharding import digits_batch, mlp

    rank, world = dist.get_rank(), dist.get_world_size()
    images, labels = digits_batch(MICRO * MICRO_SIZE * world, start=40)
    ddp = DDP(mlp(seed=3, dtype=torch.float64))
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.5)
    mine = images[rank::world], labels[rank::world]       # this rank's share of the global batch
    if student is None:                                     # one backward: DDP's one round of all_reduce
        F.cross_entropy(ddp(mine[0]), mine[1]).backward()
        return {"weights": None}
    batches = [(mine[0][i * MICRO_SIZE:(i + 1) * MICRO_SIZE], mine[1][i * MICRO_SIZE:(i + 1) * MICRO_SIZE])
               for i in range(MICRO)]
    before = _weights(ddp).clone()
    student(ddp, sgd, batches)
    # the reference: one process, one step on the whole global batch (the mean over every sample)
    one = mlp(seed=3, dtype=torch.float64)
    ref = torch.optim.SGD(one.parameters(), lr=0.5)
    F.cross_entropy(one(images), labels).backward()
    ref.step()
    # An SGD update is -lr times the gradient: the student's update over the expected one is the
    # ratio of their gradients, the number that names the mistake (4x: summed, not divided).
    got, expected = _weights(ddp) - before, _weights(one) - before
    ratio = float((got * expected).sum() / (expected * expected).sum())
    return {"gap": (_weights(ddp) - _weights(one)).abs().max().item(), "ratio": ratio,
            "scaled": bool(torch.allclose(got, ratio * expected, rtol=1e-9, atol=1e-12))}


def _ratio_hint(ratio: float, scaled: bool, world: int) -> str:
    """What the ratio of the student's update to the expected one says about the mistake."""
    if not scaled:
        return ("your update is not a multiple of the expected one: the micro-batches' gradients were "
                "not all summed into one step (a zero_grad or an optimizer.step inside the loop?). "
                "Zero once before the loop, step once after it.")
    said = f"your gradients are {ratio:.2f}× the expected"
    if abs(ratio - MICRO) < 1e-6:
        return (f"{said}: you summed over the {MICRO} micro-batches without dividing. Scale each "
                f"micro-batch's loss by 1 / len(batches): the batch's loss is their mean.")
    if abs(ratio - 1 / MICRO) < 1e-6:
        return (f"{said}: the mean was taken twice. Divide each micro-batch's loss by "
                f"len(batches) once, and nothing else.")
    if abs(ratio - world) < 1e-6 or abs(ratio - 1 / world) < 1e-6:
        return (f"{said}, a factor of the world size ({world}): DDP already averages over the ranks; "
                f"do not multiply or divide by the world size.")
    if abs(ratio) < 1e-12:
        return "the weights did not move: call optimizer.step() once, after the loop."
    return (f"{said}: scale each micro-batch's loss by 1 / len(batches), no other factor, "
            f"and step once.")


def _all_reduces(trace: Any, rank: int) -> int:
    return sum(1 for e in trace.events if e.rank == rank and e.op == "all_reduce")


def _backwards(trace: Any, rank: int) -> int:
    return sum(1 for e in trace.compute if e.rank == rank and e.op == "backward")


@checker
def accumulate(lab: Any = None) -> None:
    """Check ``accumulate(ddp, optimizer, batches)``: no_sync for all but the last micro-batch."""
    __tracebackhide__ = True
    n = lab.world_size
    with lab.trace() as once:
        run_student_code("one DDP backward", _accumulate_run, None, lab=lab, timeout=_TIMEOUT, hint="")
    with lab.trace() as trace:
        got = _student("accumulate", lab, _accumulate_run)
    per_backward = [_all_reduces(once, rank) for rank in range(n)]
    counted = [_all_reduces(trace, rank) for rank in range(n)]
    if counted == [MICRO * c for c in per_backward]:
        hint = (f"every one of the {MICRO} backwards all_reduced: run all but the last micro-batch "
                f"inside `with ddp.no_sync():`, the forward too (DDP decides in forward whether "
                f"the backward that follows all_reduces).")
    elif counted == [0] * n:
        hint = "nothing was all_reduced: the last micro-batch's backward must run outside no_sync."
    else:
        hint = "all but the last backward inside `with ddp.no_sync():`, the last one outside it."
    compare(f"gradient all_reduces in one accumulate(...) step over {MICRO} micro-batches",
            per_backward, counted, hint=hint)
    # One backward over the concatenated micro-batches gives the same weights and one
    # all_reduce, but it is one larger batch: the memory accumulation exists to save.
    compare(f"backward passes in one accumulate(...) step over {MICRO} micro-batches", [MICRO] * n,
            [_backwards(trace, rank) - 1 for rank in range(n)],    # less the reference's one
            hint="a forward and a backward per micro-batch: one backward over all of them at once is "
                 "one larger batch, and needs the activation memory that accumulation exists to save.")
    gaps = [g["gap"] for g in got]
    holds("the weights after the step equal one step on the whole batch (to 1e-12)",
          [gap <= 1e-12 for gap in gaps], hint=_ratio_hint(got[0]["ratio"], got[0]["scaled"], n))
    passed(f"{MICRO} micro-batches, one round of all_reduce, and the weights of one step on the "
           f"whole batch.")
