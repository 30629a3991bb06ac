"""Checker for notebook 11's gradient clipping across FSDP2 shards.

- ``clip_sharded()``: ``clip_sharded(model, max_norm)`` clips the gradients of
  an FSDP2 model (each rank holds a shard of every gradient) by their *global*
  norm, computed from each rank's sum of squares with one ``dist.all_reduce``,
  and returns that norm. Compared, in float64, with ``clip_grad_norm_`` on one
  process over the whole batch (to 1e-10); torch's ``clip_grad_norm_``, which
  knows DTensors, is refused for the student's call. A wrong norm is named by
  its ratio to the right one (one shard's only, or the norms added instead of
  the squares). The samples and the max_norms are drawn for each check from a
  seed no rank sees, each rank sent only its samples (``Lab.run_each``); the
  one-process reference is computed and compared in the checker.
"""

from __future__ import annotations

from typing import Any, Callable

from .._core import checker, compare, holds, passed, run_student_function

__all__ = ["clip_sharded"]

_TIMEOUT = 60.0
#: max_norm as a fraction of the true norm, drawn per check from these ranges: one that clips, one
#: that does not.
FRACTIONS = ((0.2, 0.5), (2.0, 5.0))


def _counted(student: Callable, model: Any, max_norm: float) -> tuple[Any, int]:
    """On a rank: the student's call, torch's clipping refused, its dist.all_reduce calls counted."""
    import torch.distributed as dist

    from ddplab.check._forbid import refusing_library

    # Counted where every all_reduce goes (the process group's method), not at dist.all_reduce:
    # `from torch.distributed import all_reduce` before the check holds the function itself.
    group, calls = dist.ProcessGroup, [0]
    raw = group.__dict__["allreduce"]                 # the raw descriptor: restoring it keeps binding
    call = group.allreduce

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return call(self, *args, **kwargs)

    group.allreduce = counting
    try:
        with refusing_library(("clip_grad_norm_",), "clip_sharded",
                              builds="gradient clipping across shards"):
            got = student(model, max_norm)
    finally:
        group.allreduce = raw
    return got, calls[0]


def _answers(student: Callable, x: Any, y: Any, max_norms: list[float]) -> list[dict]:
    """On a rank: per max_norm, the student's norm, its all_reduce calls and the clipped gradients.

    ``x``, ``y`` are this rank's samples and ``max_norms`` the limits, drawn by the
    checker and sent to this rank alone; the checker compares in its own process.
    """
    import torch
    import torch.nn.functional as F

    from ddplab.checkpointing import fsdp_mlp

    out = []
    for max_norm in max_norms:
        model = fsdp_mlp(seed=4)
        F.cross_entropy(model(x), y).backward()        # FSDP2: each rank its shard of the mean gradient
        got, calls = _counted(student, model, max_norm)
        grads = [p.grad.full_tensor() for p in model.parameters()]     # every rank calls it
        one_value = isinstance(got, (float, int, torch.Tensor)) and torch.as_tensor(got).numel() == 1
        out.append({"norm": float(got) if one_value else None, "calls": calls, "grads": grads})
    return out


def _drawn(world: int) -> tuple[Any, Any, list[float]]:
    """In the checker: ``16 * world`` digits and the two max_norms' fractions, from a seed drawn now.

    The fractions are drawn too, so that a max_norm does not tell a rank the global norm.
    """
    import random
    import secrets

    import torch

    from ddplab.data import digits

    seed = secrets.randbits(62)
    train_set, _ = digits(dtype=torch.float64)
    rows = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))[:16 * world]
    draw = random.Random(seed)
    images, labels = train_set[rows]
    return images, labels, [draw.uniform(*FRACTIONS[0]), draw.uniform(*FRACTIONS[1])]


def _one_process(images: Any, labels: Any, fraction: float) -> tuple[float, float, list]:
    """In the checker: max_norm (``fraction`` of the norm), the norm and the gradients clip_grad_norm_
    leaves, on one process over every rank's samples."""
    import torch
    import torch.nn.functional as F

    from ddplab.sharding import mlp

    one = mlp(seed=4, dtype=torch.float64)
    F.cross_entropy(one(images), labels).backward()
    norm = torch.nn.utils.clip_grad_norm_(one.parameters(), float("inf")).item()   # clips nothing
    expected = torch.nn.utils.clip_grad_norm_(one.parameters(), fraction * norm).item()
    return fraction * norm, expected, [p.grad for p in one.parameters()]


def _same_grads(got: Any, expected: list) -> bool:
    import torch

    return (isinstance(got, list) and len(got) == len(expected)
            and all(isinstance(g, torch.Tensor) and g.shape == e.shape
                    and bool(torch.allclose(g, e, rtol=0, atol=1e-10)) for g, e in zip(got, expected)))


def _norm_hint(got: float | None, expected: float, world: int) -> str:
    """What the ratio of the student's norm to the global one says about the mistake."""
    if got is None:
        return "return the global norm, as a float (or a one-element tensor)."
    ratio = got / expected
    said = f"your norm is {ratio:.3f}× the global one"
    if ratio < 1:
        return (f"{said}: it is one shard's only. Sum the squares of this rank's gradient shards "
                f"(p.grad.to_local()), all_reduce that sum, then take the square root.")
    if ratio > 1:
        return (f"{said}: norms do not add up. All_reduce the sum of squares (not the norms, nor "
                f"the squares' square roots), and take the square root once, after it.")
    return "the norm: the square root of the all_reduced sum of every shard's squared gradients."


@checker
def clip_sharded(lab: Any = None) -> None:
    """Check ``clip_sharded(model, max_norm)``: the global norm of FSDP2's sharded gradients, clipped."""
    __tracebackhide__ = True
    n = lab.world_size
    images, labels, fractions = _drawn(n)
    ones = [_one_process(images, labels, fraction) for fraction in fractions]
    got = run_student_function("clip_sharded", _answers, lab=lab, timeout=_TIMEOUT,
                               hint="every rank must all_reduce its sum of squares: a rank that "
                                    "skips it leaves the others waiting.",
                               each={r: (images[16 * r:16 * (r + 1)], labels[16 * r:16 * (r + 1)],
                                         [max_norm for max_norm, _, _ in ones]) for r in range(n)})
    for i, fraction in enumerate(fractions):
        _, expected, grads = ones[i]
        rows = [dict(g[i], expected=expected, grads=_same_grads(g[i]["grads"], grads)) for g in got]
        what = "clips" if fraction < 1 else "does not clip"
        compare(f"dist.all_reduce calls in clip_sharded (max_norm {what})", [1] * n,
                [r["calls"] for r in rows],
                hint="one dist.all_reduce of this rank's sum of squared gradient shards gives every "
                     "rank the global sum: not one per parameter, and not none.")
        first = rows[0]
        close = [r["norm"] is not None and abs(r["norm"] - r["expected"]) <= 1e-10 for r in rows]
        holds(f"the norm clip_sharded returned (max_norm {what}) equals clip_grad_norm_'s on one "
              f"process (to 1e-10)", close, hint=_norm_hint(first["norm"], first["expected"], n))
        holds(f"the clipped gradients (max_norm {what}) equal clip_grad_norm_'s on one process "
              f"(to 1e-10)", [r["grads"] for r in rows],
              hint="scale every shard in place by the coefficient clip_grad_norm_ uses (max_norm "
                   "over the norm, never above 1)." if fraction < 1 else
                   "when the norm is below max_norm, leave the gradients as they are (the "
                   "coefficient is clamped to 1).")
    passed("clip_sharded computes the global norm from every shard's sum of squares with one "
           "all_reduce, and clips exactly as clip_grad_norm_ does on one process.")
