"""On a rank, for notebook 13's checks: watch a pipeline exercise's messages and train with it.

``watching`` follows the student's ``send``/``recv``/``isend``/``irecv`` for one call:
a message to or from a rank that is not a neighbouring stage raises at once
(a micro-batch sent to the wrong stage), and every request that ``isend``/``irecv``
returned and nobody waited on is noted (a missing wait). ``train`` runs
``k`` steps of the student's schedule on this rank's stage, with the check's own
SGD step between them, and reports what the checker compares; ``reference``
(in the kernel) is one process training the whole model on the whole batch.
The model's weights and the batches are drawn by the checker for each check
(``drawn``) and each rank is sent only its block and the data its stage reads
(``sent_to``, ``Lab.run_each``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .._feedback import Feedback
from .._forbid import COLLECTIVES, forbidding, refusing_library
from .._peers import peer, swap_peer_calls

#: What a pipeline exercise may not use: it builds the schedule itself.
REFUSED = ("torch.distributed.pipelining", "batch_isend_irecv")
#: The check's learning rate: big enough that a wrong gradient moves the weights visibly.
LR = 0.5


class _Request:
    """A request ``isend``/``irecv`` returned, which notes whether anybody waited on it."""

    def __init__(self, work: Any, what: str) -> None:
        self.work, self.what, self.waited = work, what, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def watching(exercise: str, log: dict) -> Iterator[None]:
    """Follow the p2p calls of the block on this rank; ``log`` gets ``sent``, ``received``, ``unwaited``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    requests: list[_Request] = []
    depth = [0]                          # torch's send is its isend and a wait: count the outer call only
    log.setdefault("sent", {})
    log.setdefault("received", {})

    def wrap(name: str, keyword: str, real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if depth[0]:
                return real(*args, **kwargs)
            other = peer(args, kwargs, keyword)
            if isinstance(other, int) and (abs(other - rank) != 1 or not 0 <= other < world):
                kind = "sent a micro-batch to" if keyword == "dst" else "waited for a micro-batch from"
                raise Feedback(
                    f"{exercise}: rank {rank} {kind} rank {other} (dist.{name}({keyword}={other})), "
                    f"which is not a neighbouring stage: a micro-batch sent to the wrong stage.",
                    hint=f"stage r sends activations only to stage r + 1 and gradients only to "
                         f"stage r - 1 (here stage = rank, {world} stages).")
            book = log["sent"] if keyword == "dst" else log["received"]
            book[other] = book.get(other, 0) + 1
            depth[0] += 1
            try:
                work = real(*args, **kwargs)
            finally:
                depth[0] -= 1
            if name.startswith("i"):
                request = _Request(work, f"dist.{name}({keyword}={other})")
                requests.append(request)
                return request
            return work
        return call

    undo = swap_peer_calls(wrap)
    try:
        with forbidding(COLLECTIVES, exercise, "a pipeline schedule"), \
                refusing_library(REFUSED, exercise, "a pipeline schedule"):
            yield
    finally:
        undo()
    log["unwaited"] = log.get("unwaited", []) + [r.what for r in requests if not r.waited]
    for request in requests:             # the check's own: no message left in flight between steps
        if not request.waited:           # (waiting twice on gloo's recv waits for another message)
            request.work.wait()


def _stage(weights: dict, work: float = 0.0) -> Any:
    """On a rank: its ``pipeline.Stage``, with the block's weights the checker sent (``weights``)."""
    import torch.distributed as dist

    from ddplab import pipeline

    stage = pipeline.Stage(pipeline.model(dist.get_world_size()), dist.get_rank(), work=work)
    stage.block.load_state_dict(weights)
    return stage


def train(student: Callable, exercise: str, weights: dict, batches: list, work: float = 0.0) -> dict:
    """On a rank: one step of ``student(stage, inputs, targets)`` per ``batches``, each followed by SGD.

    ``weights`` (this rank's block) and ``batches`` (each step's ``(inputs, targets)``:
    the real inputs on the first stage, the real targets on the last, zeros of their
    shapes elsewhere) were drawn by the checker and sent to this rank alone.
    Returns the first step's gradients and stage log, every step's messages and
    unwaited requests, and the weights after the last step.
    """
    import torch
    import torch.distributed as dist

    stage = _stage(weights, work)
    out: dict[str, Any] = {"logs": [], "messages": []}
    for inputs, targets in batches:
        stage.zero_grad(set_to_none=True)
        stage.log.clear()
        log: dict = {}
        dist.barrier()
        with watching(exercise, log):
            student(stage, inputs, targets)
        out["logs"].append(list(stage.log))
        out["messages"].append({"sent": log["sent"], "received": log["received"]})
        out.setdefault("unwaited", log["unwaited"])
        grads = [None if p.grad is None else p.grad.detach().clone() for p in stage.parameters()]
        out.setdefault("grads", grads)
        with torch.no_grad():
            for p in stage.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    out["weights"] = [p.detach().clone() for p in stage.parameters()]
    dist.barrier()
    return out


def forward_once(student: Callable, exercise: str, weights: dict, micro_batch: Any) -> dict:
    """On a rank: ``student(stage, micro_batch)`` once, the stage's output and the messages.

    ``micro_batch`` is the real one on rank 0 and zeros of its shape elsewhere.
    """
    import torch
    import torch.distributed as dist

    stage = _stage(weights)
    log: dict = {}
    dist.barrier()
    with watching(exercise, log):
        got = student(stage, micro_batch.clone())
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    dist.barrier()
    return {"output": got, "sent": log["sent"], "received": log["received"],
            "unwaited": log["unwaited"], "log": list(stage.log)}


def drawn(p: int, steps: int, m: int, rows: int = 2) -> tuple[Any, list]:
    """In the checker: the model of ``p`` stages and ``steps`` batches of ``m`` micro-batches, drawn now.

    From seeds no rank sees: a rank knows another stage's weights, or the
    batch (unless it is the first stage) only by communicating.
    """
    import secrets

    from ddplab import pipeline

    return (pipeline.model(p, seed=secrets.randbits(40)),
            [pipeline.micro_batches(m, rows=rows, seed=secrets.randbits(40)) for _ in range(steps)])


def sent_to(rank: int, p: int, whole: Any, batches: list) -> tuple[dict, list]:
    """What rank ``rank`` is sent: its block's weights, and each batch with what it does not read zeroed.

    Stage 0 reads the inputs and the last stage the targets; the other lists
    keep their shapes (a stage makes its buffers with ``torch.empty_like``).
    """
    import torch

    def kept(tensors: list, keep: bool) -> list:
        return [t.clone() if keep else torch.zeros_like(t) for t in tensors]

    weights = {k: v.detach().clone() for k, v in whole[rank].state_dict().items()}
    return weights, [(kept(x, rank == 0), kept(y, rank == p - 1)) for x, y in batches]


def reference(whole: Any, batches: list) -> tuple[list[list], list[list], dict[str, list[list]]]:
    """One process, the whole batch: each stage's weights after a step per batch and the first gradients.

    Also the first step's gradients of the wrong answers the check names: not
    averaged (``m`` times too large), of the last micro-batch only, averaged twice.
    """
    import copy

    import torch

    from ddplab import pipeline

    whole = copy.deepcopy(whole)
    p, m = len(whole), len(batches[0][0])

    def grads_of(inputs, targets, scale):
        whole.zero_grad(set_to_none=True)
        (scale * pipeline.loss_fn(whole(torch.cat(inputs)), torch.cat(targets))).backward()
        return [[q.grad.clone() for q in whole[r].parameters()] for r in range(p)]

    inputs, targets = batches[0]
    wrong = {"m times too large: each micro-batch's loss was not divided by the number of "
             "micro-batches (the batch's loss is their mean)": grads_of(inputs, targets, m),
             "1/m of the right ones: the loss was divided by the number of micro-batches twice":
                 grads_of(inputs, targets, 1 / m),
             "those of the last micro-batch only: the gradients were not accumulated over the "
             "micro-batches (a zero_grad, or grads replaced, between them)":
                 grads_of(inputs[-1:], targets[-1:], 1 / m),
             "those of the last micro-batch only, not divided by m: the gradients were not "
             "accumulated over the micro-batches": grads_of(inputs[-1:], targets[-1:], 1)}
    first = grads_of(inputs, targets, 1)
    for inputs, targets in batches:
        grads_of(inputs, targets, 1)
        with torch.no_grad():
            for q in whole.parameters():
                q -= LR * q.grad
    weights = [[q.detach().clone() for q in whole[r].parameters()] for r in range(p)]
    return weights, first, wrong


def close(a: list, b: list, atol: float = 1e-12) -> bool:
    import torch

    return all(x is not None and x.shape == y.shape and torch.allclose(x, y, atol=atol, rtol=0)
               for x, y in zip(a, b))


def warm(student: Any = None) -> None:
    """On a rank: import what the checks run and do one forward and backward, before their timeout.

    Refusing ``torch.distributed.pipelining`` imports it, which takes seconds; so
    may the module of the student's function, which arrives here (unpickled) as
    ``student`` and is not called.
    """
    from ddplab import pipeline

    with refusing_library(REFUSED, "warm-up", "nothing"):
        pass

    stage = pipeline.Stage(pipeline.model(1), 0)
    inputs, targets = pipeline.micro_batches(1)
    pipeline.loss_fn(stage(inputs[0]), targets[0]).backward()
