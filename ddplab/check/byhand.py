"""Checkers for notebook 05's "DDP by hand" section: gradient averaging written by the student.

    ddplab.check.average_gradients()            # one all_reduce per parameter
    ddplab.check.average_gradients_flat()       # all gradients in one flat tensor, fewer all_reduces

Each runs, on every rank, 5 SGD steps of ``train.SmallCNN`` in float64 twice
from the same start: once calling the student's function between
``backward()`` and ``step()``, once under ``DistributedDataParallel``. Every
rank gets its own batches, so a function that does not average (or averages
the wrong thing) ends with weights that differ from DDP's. It also counts the
student's ``dist.all_reduce`` calls per step.
"""

from __future__ import annotations

from typing import Any

from ._core import compare, lab_or_current, passed, require_function, run_student_code

__all__ = ["average_gradients", "average_gradients_flat"]

_MISSING = "<no such function on this rank>"
_TIMEOUT = 90.0
_STEPS, _BATCH = 5, 8


def _train_both(name: str, steps: int, batch: int) -> Any:
    """On a rank: the weights after ``steps`` steps by hand and under DDP, and all_reduce calls per step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab import data, train
    from ddplab.rank.engine import namespace

    student = namespace().get(name)
    if not callable(student):
        return _MISSING
    rank, n = dist.get_rank(), dist.get_world_size()
    device = train.device_for_this_rank()
    train_set, _ = data.digits(dtype=torch.float64)

    def batches():
        for step in range(steps):                      # rank r of step s: its own 8 samples
            start = (step * n + rank) * batch
            x, y = train_set[start:start + batch]
            yield x.to(device), y.to(device)

    def fresh():
        torch.manual_seed(0)                           # the same start on every rank, no broadcast needed
        return train.SmallCNN().double().to(device)

    model = fresh()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    real_all_reduce, calls = dist.all_reduce, [0]

    def counting_all_reduce(*args, **kwargs):
        calls[0] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce              # student code looks it up as dist.all_reduce
    try:
        for x, y in batches():
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            student(model)
            sgd.step()
    finally:
        dist.all_reduce = real_all_reduce
    by_hand = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()

    ddp = DDP(fresh(), device_ids=[device.index] if device.type == "cuda" else None)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches():
        sgd.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        sgd.step()
    reference = torch.cat([p.detach().flatten() for p in ddp.parameters()]).cpu()
    return {"gap": (by_hand - reference).abs().max().item(), "calls": calls[0] / steps,
            "params": sum(1 for _ in model.parameters())}


def _run(name: str, lab: Any, timeout: float) -> list[dict]:
    got = run_student_code(f"{name}(model)", _train_both, name, _STEPS, _BATCH, lab=lab,
                           timeout=timeout, hint="every rank must all_reduce the same "
                                                 "parameters, in the same order.")
    require_function(got, name, _MISSING)
    return got


def _same_as_ddp(name: str, got: list[dict], n: int) -> None:
    close = [g["gap"] <= 1e-9 for g in got]
    compare(f"weights after {_STEPS} SGD steps with {name}(model), equal to DDP's (to 1e-9)",
            [True] * n, close,
            hint=f"after backward(), every rank must hold the mean of all ranks' gradients: "
                 f"all_reduce each p.grad (SUM), then divide it by world_size, in place. "
                 f"Largest difference from DDP: {max(g['gap'] for g in got):.3g}.")


def average_gradients(lab: Any = None, timeout: float = _TIMEOUT) -> None:
    """Check ``average_gradients(model)``: after it, every ``p.grad`` is the mean over ranks, as DDP's."""
    lab = lab_or_current(lab)
    got = _run("average_gradients", lab, timeout)
    _same_as_ddp("average_gradients", got, lab.world_size)
    passed(f"{_STEPS} steps with average_gradients(model) end on DDP's weights, on every rank.")


def average_gradients_flat(lab: Any = None, timeout: float = _TIMEOUT) -> None:
    """Check ``average_gradients_flat(model)``: DDP's weights, with fewer all_reduces than parameters."""
    lab = lab_or_current(lab)
    n = lab.world_size
    got = _run("average_gradients_flat", lab, timeout)
    _same_as_ddp("average_gradients_flat", got, n)
    params = got[0]["params"]
    compare(f"all_reduce calls per step, fewer than the model's {params} parameters",
            [True] * n, [g["calls"] < params for g in got],
            hint=f"flatten every gradient into one tensor (torch.cat of p.grad.flatten()), all_reduce "
                 f"that once, then copy the pieces back into p.grad. Counted per step: "
                 f"{got[0]['calls']:g}.")
    passed(f"one flat all_reduce per step gives DDP's weights after {_STEPS} steps, on every rank.")
