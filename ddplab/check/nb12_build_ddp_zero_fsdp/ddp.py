"""Checkers for notebook 12, part 1: DDP built by hand, overlapped and bucketed.

    ddplab.check.overlap_hooks(overlap_hooks, wait_for_gradients)
    ddplab.check.bucketed_all_reduce(bucketed_all_reduce)   # (model, bucket_cap_bytes)

Each ships the student's functions to the ranks (cloudpickle), trains
``_steps64.model()`` with them for a few SGD steps, every rank on its own
rows of each batch (drawn per check from a seed no rank sees, each rank sent
only its rows), and compares the weights here with one process trained on
the whole batch in float64 (1e-12). The student's ``dist.all_reduce`` calls
are recorded (``AllReduceLog``): the
overlap check asserts from their order that an all_reduce started while
``backward()`` was still running and that every handle was waited for before
the optimizer step; the bucket check that the buckets went out in the order
backward produces gradients, each holding what the cap allows. Using
``DistributedDataParallel`` (or torch's other sharding libraries) is refused.
Nothing a table or message shows is a value to copy: the weights are compared
by their distance, the all_reduces by their order and sizes.
"""

from __future__ import annotations

from typing import Any

from ...text import plural
from .._core import checker, passed, run_student_code
from .._feedback import Feedback
from .._forbid import refusing_library
from . import _steps64 as steps64

__all__ = ["bucketed_all_reduce", "overlap_hooks"]

#: The bucket cap the check uses: 320 bytes, 40 float64 values, so the tiny model makes 3 buckets.
CAP_BYTES = 320
_HANG = ("every rank must issue the same all_reduces in the same order, and wait for each handle "
         "it started.")


# ------------------------------------------------------------------ on a rank
def _train_overlap(install: Any, finish: Any, rows: list) -> Any:
    """On a rank: train on ``rows`` with the student's hooks; the weights and the log of all_reduce calls."""
    net = steps64.model()
    opt = steps64.optimizer("sgd", net.parameters())
    unwaited = []
    with refusing_library(steps64.LIBRARY, "overlap_hooks", "DDP's overlap"), \
            steps64.AllReduceLog() as log:
        handles = install(net)
        for step, (x, y) in enumerate(rows):
            log.step = step
            opt.zero_grad(set_to_none=True)
            log.in_backward = True
            steps64.loss(net, x, y).backward()
            log.in_backward = False
            finish(handles)
            unwaited.append(log.unwaited(step))
            opt.step()
    return {"weights": steps64.flat(net), "calls": log.calls, "unwaited": unwaited,
            "params": len(list(net.parameters()))}


def _train_bucketed(fn: Any, cap: int, rows: list) -> Any:
    """On a rank: train on ``rows`` with the student's bucketed all_reduce after each backward."""
    net = steps64.model()
    opt = steps64.optimizer("sgd", net.parameters())
    with refusing_library(steps64.LIBRARY, "bucketed_all_reduce", "DDP's buckets"), \
            steps64.AllReduceLog() as log:
        for step, (x, y) in enumerate(rows):
            log.step = step
            opt.zero_grad()
            steps64.loss(net, x, y).backward()
            fn(net, cap)
            opt.step()
    return {"weights": steps64.flat(net), "calls": log.calls}


def plan(sizes: list[int], cap: int, itemsize: int = 8) -> list[int]:
    """Elements per bucket when parameters of ``sizes`` elements are taken in this order.

    A bucket closes as soon as it holds at least ``cap`` bytes (and at the end).
    """
    buckets, current = [], 0
    for n in sizes:
        current += n
        if current * itemsize >= cap:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


# ------------------------------------------------------------------ the checks
OVERLAP_HINT = ("each gradient's all_reduce starts from a hook that runs as soon as that gradient "
                "is accumulated (torch has one per parameter), without waiting for it, and its "
                "handle is kept in the list overlap_hooks returns; every gradient is averaged once. "
                "wait_for_gradients(handles) waits on each kept handle, then empties the list.")


@checker
def overlap_hooks(install: Any, finish: Any, lab: Any = None) -> None:
    """Check ``overlap_hooks(model)`` and ``wait_for_gradients(handles)``: DDP's overlap, by hand.

    Called as ``ddplab.check.overlap_hooks(overlap_hooks, wait_for_gradients)``.
    """
    __tracebackhide__ = True
    steps64.require_callables("ddplab.check.overlap_hooks(overlap_hooks, wait_for_gradients)",
                              overlap_hooks=install, wait_for_gradients=finish)
    batches = steps64.drawn(lab.world_size)
    got = run_student_code("overlap_hooks(model) and wait_for_gradients(handles)", _train_overlap,
                           install, finish, lab=lab, timeout=steps64.TIMEOUT, hint=_HANG,
                           each=steps64.each_rank(batches, lab.world_size))
    got = [got[rank] for rank in range(lab.world_size)]
    first = got[0]
    calls = first["calls"]
    if not calls:
        raise Feedback("overlap_hooks: no dist.all_reduce was called in a training step, so the "
                       "ranks never averaged their gradients.", hint=OVERLAP_HINT)
    if not any(call["async_op"] for call in calls):
        raise Feedback("overlap_hooks: every dist.all_reduce was blocking (no async_op=True), so "
                       "backward stops at each gradient until it is summed: nothing overlaps.",
                       hint=OVERLAP_HINT)
    if not any(call["in_backward"] for call in calls):
        raise Feedback("overlap_hooks: every all_reduce started after backward() had ended, so "
                       "communication never overlaps the backward pass.",
                       hint="start each gradient's all_reduce from a hook that runs as soon as that "
                            "gradient is accumulated (torch has one per parameter).")
    missed = [(rank, step, n) for rank, g in enumerate(got) for step, n in enumerate(g["unwaited"]) if n]
    if missed:
        rank, step, n = missed[0]
        raise Feedback(f"overlap_hooks: a missing wait: on rank {rank}, in step {step}, "
                       f"{plural(n, 'all_reduce')} started with async_op=True "
                       f"{'was' if n == 1 else 'were'} never waited for before the optimizer step, "
                       f"which may then read a gradient gloo is still summing.",
                       hint="wait_for_gradients(handles) waits on every handle the hooks kept "
                            "(then empties the list for the next step).")
    per_step = sum(1 for call in calls if call["step"] == 0)
    if per_step != first["params"]:
        raise Feedback(f"overlap_hooks: {plural(per_step, 'all_reduce')} in one step for "
                       f"{first['params']} parameters: each parameter's hook should start exactly "
                       f"one (register the hook once per parameter, in overlap_hooks).",
                       hint=OVERLAP_HINT)
    steps64.verdict("overlap_hooks", "sgd", [g["weights"] for g in got], OVERLAP_HINT, batches)
    passed(f"overlap_hooks: each gradient's all_reduce started inside backward(), every handle "
           f"was waited for, and after {steps64.STEPS} steps the weights on every rank are one "
           f"process's (float64, {steps64.TOLERANCE:g}).")


BUCKET_HINT = ("take the parameters in the order backward produces their gradients (the reverse "
               "of the model's); a bucket closes once it holds at least bucket_cap_bytes; each "
               "bucket travels as one flat tensor in one all_reduce, is averaged once, and its "
               "pieces go back into the gradients they came from.")


@checker
def bucketed_all_reduce(fn: Any, lab: Any = None) -> None:
    """Check ``bucketed_all_reduce(model, bucket_cap_bytes)``: DDP's buckets, reverse order, one call each."""
    __tracebackhide__ = True
    steps64.require_callables("ddplab.check.bucketed_all_reduce(bucketed_all_reduce)",
                              bucketed_all_reduce=fn)
    batches = steps64.drawn(lab.world_size)
    got = run_student_code(f"bucketed_all_reduce(model, {CAP_BYTES})", _train_bucketed, fn,
                           CAP_BYTES, lab=lab, timeout=steps64.TIMEOUT, hint=_HANG,
                           each=steps64.each_rank(batches, lab.world_size))
    got = [got[rank] for rank in range(lab.world_size)]
    sizes = [p.numel() for p in steps64.model().parameters()]
    expected = plan(sizes[::-1], CAP_BYTES)
    calls = [call["numel"] for call in got[0]["calls"] if call["step"] == 0]
    intro = (f"bucketed_all_reduce(model, {CAP_BYTES}) on a model of {len(sizes)} parameters "
             f"({sum(sizes)} float64 values) made {plural(len(calls), 'all_reduce')} of "
             f"{calls} elements")
    if calls != expected:
        if sorted(calls) == sorted(expected):
            why = ("the right buckets, flushed in the wrong order: the first bucket to go must be "
                   "the one that holds the last parameters, whose gradients backward computes first")
        elif calls == plan(sizes, CAP_BYTES):
            why = ("its buckets were filled in the forward order of the parameters; DDP fills them "
                   "in reverse, the order backward produces the gradients")
        elif len(calls) >= len(sizes):
            why = "that is one all_reduce per parameter (or more), not one per bucket"
        elif sum(calls) != sum(sizes):
            why = f"together {sum(calls)} values, but the gradients hold {sum(sizes)}"
        else:
            why = (f"buckets of other sizes than a cap of {CAP_BYTES} bytes gives: a bucket closes "
                   f"as soon as it holds at least bucket_cap_bytes")
        raise Feedback(f"{intro}: {why}.", hint=BUCKET_HINT)
    steps64.verdict("bucketed_all_reduce", "sgd", [g["weights"] for g in got], BUCKET_HINT, batches)
    passed(f"bucketed_all_reduce: {len(expected)} buckets in the order backward fills them, one "
           f"all_reduce each, and after {steps64.STEPS} steps the weights on every rank are one "
           f"process's (float64, {steps64.TOLERANCE:g}).")
