"""Checkers for notebook 05's "DDP by hand" section: gradient averaging written by the student.

    ddplab.check.average_gradients()            # one all_reduce per parameter
    ddplab.check.average_gradients_flat()       # all gradients in one flat tensor, fewer all_reduces

Each runs, on every rank, 5 SGD steps of ``train.SmallCNN`` in float64, calling
the student's function between ``backward()`` and ``step()``. Every rank gets
its own batches, drawn by the checker from a seed no rank sees and sent to
that rank alone (``Lab.run_each``), so a rank learns the others' gradients
only by communicating. The weights come back, and the checker compares them
here, with its own torch, with DDP's computed in one process (each rank's
gradient, summed and divided by the number of ranks): nothing on a rank holds
or computes the verdict. It also counts the all_reduces the student's function
issues per step, as torch's flight recorder saw them (``_forbid.counting``: an
alias of ``dist.all_reduce`` is counted too). When the weights differ, one more step says what the
function did to the gradients, by its effect: the sum (no division), the mean
times a constant (divided by a fixed number), left unchanged (a temporary
copy was reduced, or nothing), or only some of them.
"""

from __future__ import annotations

from typing import Any

from ...rank import flight
from .._core import MISSING, checker, passed, require_function, run_student_code, warm_up_ddp
from .._feedback import Feedback, Row, ranks_phrase
from .._forbid import counting

__all__ = ["average_gradients", "average_gradients_flat"]

_TIMEOUT = 15.0            # the 5 steps take about a second: longer is a deadlock
_STEPS, _BATCH = 5, 8
_HANG = "every rank must all_reduce the same parameters, in the same order."


def _train_by_hand(name: str, xs: Any, ys: Any) -> Any:
    """On a rank: the weights after one SGD step per batch of ``xs``/``ys``, the student's function
    called between ``backward()`` and ``step()``; and its all_reduce calls per step.

    ``xs``/``ys`` are this rank's batches, drawn by the checker and sent to this rank
    alone (``Lab.run_each``). Nothing here knows what the weights should be: the
    checker computes that in its own process (``_reference``).
    """
    import torch
    import torch.nn.functional as F

    from ddplab import train
    from ddplab.rank.engine import namespace

    student = namespace().get(name)
    if not callable(student):
        return MISSING
    device = train.device_for_this_rank()
    torch.manual_seed(0)                               # the same start on every rank, no broadcast needed
    model = train.SmallCNN().double().to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []                                         # per step: one look at the recorder each
    for x, y in zip(xs, ys):
        sgd.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        with counting("all_reduce") as count:
            student(model)
        calls.append(count[0])
        sgd.step()
    return {"weights": torch.cat([p.detach().flatten() for p in model.parameters()]).cpu(),
            "calls": -1 if -1 in calls else sum(calls) / len(xs),
            "params": sum(1 for _ in model.parameters())}


def _batches(n: int, steps: int, batch: int) -> tuple[list[Any], list[Any]]:
    """Each rank's batches ``(xs[r], ys[r])``: digits drawn from a seed no rank sees, fresh per check.

    Rank ``r`` is sent only its own; so the whole batch of a step, which the
    average stands for, is known to a rank only through communication.
    """
    import secrets

    import torch

    from ddplab import data

    train_set, _ = data.digits(dtype=torch.float64)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(secrets.randbits(62)))
    x, y = train_set[order[:steps * n * batch]]
    x, y = x.view(steps, n, batch, *x.shape[1:]), y.view(steps, n, batch)
    return [x[:, r].clone() for r in range(n)], [y[:, r].clone() for r in range(n)]


def _reference(xs: list[Any], ys: list[Any]) -> Any:
    """In the checker's process: DDP's weights, computed in one process in float64.

    Each step, each rank's gradient of its own batch, summed over ranks and
    divided by their number (what DDP's all_reduce leaves), then the SGD step.
    """
    import torch
    import torch.nn.functional as F

    from ddplab import train

    with torch.random.fork_rng():                      # the notebook's random stream stays as it was
        torch.manual_seed(0)
        model = train.SmallCNN().double()
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=0.1)
    for step in range(len(xs[0])):
        grads = [torch.autograd.grad(F.cross_entropy(model(x[step]), y[step]), params)
                 for x, y in zip(xs, ys)]
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in grads) / len(xs)
        sgd.step()
    return torch.cat([p.detach().flatten() for p in params])


def _run(name: str, lab: Any, timeout: float) -> list[dict]:
    """The student's training on the ranks, each on its own batches; ``gap``: the distance to DDP's."""
    import torch

    warm_up_ddp(lab)
    xs, ys = _batches(lab.world_size, _STEPS, _BATCH)
    got = run_student_code(f"{name}(model)", _train_by_hand, name, lab=lab, timeout=timeout,
                           hint=_HANG,
                           each={rank: (xs[rank], ys[rank]) for rank in range(lab.world_size)})
    got = [got[rank] for rank in range(lab.world_size)]
    require_function(got, name)
    expected = _reference(xs, ys)
    for g in got:
        weights = g["weights"]
        good = isinstance(weights, torch.Tensor) and weights.shape == expected.shape
        g["gap"] = float((weights.double() - expected).abs().max()) if good else float("inf")
    return got


def _one_step(name: str, batch: int) -> Any:
    """On a rank: what ``name`` did to each gradient in one step, judged by its effect.

    Per parameter, the gradient after the student's call is compared with this
    rank's own gradient, the mean over ranks and the sum (both computed here
    with torch's all_reduce on copies, before the student's call): ``"mean"``,
    ``"sum"``, ``"unchanged"``, ``("scaled", k)`` (the mean times k) or ``"other"``.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ddplab import data, train
    from ddplab.rank.engine import namespace

    student = namespace().get(name)
    rank, n = dist.get_rank(), dist.get_world_size()
    device = train.device_for_this_rank()
    train_set, _ = data.digits(dtype=torch.float64)
    x, y = train_set[rank * batch:(rank + 1) * batch]
    torch.manual_seed(0)
    model = train.SmallCNN().double().to(device)
    F.cross_entropy(model(x.to(device)), y.to(device)).backward()
    own = [p.grad.detach().clone() for p in model.parameters()]
    means = [g.clone() for g in own]
    for m in means:
        dist.all_reduce(m)
        m /= n
    with counting("all_reduce") as calls:
        student(model)

    def close(a, b) -> bool:
        return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-12))

    kinds = []
    for p, g, m in zip(model.parameters(), own, means):
        got = p.grad.detach() if p.grad is not None else torch.zeros_like(g)
        if close(got, m):
            kinds.append("mean")
        elif close(got, n * m):
            kinds.append("sum")
        elif close(got, g):
            kinds.append("unchanged")
        else:
            k = float((got.double() * m.double()).sum() / (m.double() * m.double()).sum())
            kinds.append(("scaled", k) if got.shape == m.shape and close(got, k * m) else "other")
    return {"kinds": kinds, "calls": calls[0]}


def _times(calls: float) -> str:
    """A count of all_reduces for a message: -1 is ``counting``'s "more than the recorder keeps"."""
    return f"more than {flight.BUFFER_SIZE}" if calls < 0 else f"{calls:g}"


def _diagnosis(name: str, kinds: list, calls: int, n: int) -> tuple[str, str] | None:
    """What one rank's gradients say about the mistake, and the way out; None if they hold the mean."""
    total = len(kinds)
    if all(k == "mean" for k in kinds):
        return None
    if all(k == "sum" for k in kinds):
        return (f"every gradient holds the sum over the {n} ranks, world_size times the mean: the "
                f"all_reduce is there, the division is missing",
                "the mean is the sum divided by the number of ranks; change p.grad itself, in place.")
    scaled = {round(k[1], 6) for k in kinds if isinstance(k, tuple)}
    if all(isinstance(k, tuple) for k in kinds) and len(scaled) == 1:
        factor = scaled.pop()
        return (f"every gradient is the mean times {factor:.4g}: the sum was divided by "
                f"{n / factor:.4g}, not by world_size = {n}",
                "divide by dist.get_world_size(), not by a number written in the code.")
    if all(k == "unchanged" for k in kinds):
        if calls:
            return (f"every gradient is unchanged, this rank's own, although {name} called "
                    f"dist.all_reduce {_times(calls)} time(s): it reduced a temporary copy",
                    "a copy (p.grad.clone(), torch.cat(...), .float(), a list of new tensors) is "
                    "not p.grad: reduce p.grad itself in place, or copy the result back into it.")
        return (f"every gradient is unchanged, this rank's own: {name} never called "
                f"dist.all_reduce (torch's flight recorder saw no all_reduce during the call)",
                "nothing was averaged: the gradients must travel between the ranks.")
    averaged = sum(k == "mean" for k in kinds)
    if averaged:
        return (f"{averaged} of the {total} parameters' gradients hold the mean, the other "
                f"{total - averaged} do not",
                "average every parameter's gradient (for p in model.parameters()).")
    return None


def _same_as_ddp(name: str, got: list[dict], n: int, lab: Any, timeout: float) -> None:
    wrong = [rank for rank, g in enumerate(got) if g["gap"] > 1e-9]
    if not wrong:
        return
    gap = max(g["gap"] for g in got)
    diagnosed = run_student_code(f"{name}(model)", _one_step, name, _BATCH, lab=lab,
                                 timeout=timeout, hint=_HANG)
    found = [_diagnosis(name, d["kinds"], d["calls"], n) for d in diagnosed]
    weights = (f"The weights after {_STEPS} SGD steps are not DDP's on {ranks_phrase(wrong)} "
               f"(largest difference {gap:.3g}; allowed 1e-9).")
    if any(found) and len(set(found)) == 1:
        mistake, fix = found[0]
        raise Feedback(f"after {name}(model), {mistake}.", detail=[weights], hint=fix)
    if any(found):
        raise Feedback(f"after {name}(model), the ranks' gradients differ in what they hold.",
                       rows=[Row(rank, (why[0] if why else "the mean of all ranks' gradients"),
                                 wrong=why is not None) for rank, why in enumerate(found)],
                       detail=[weights], hint="every rank must call it the same way.")
    raise Feedback(f"the weights after {_STEPS} SGD steps with {name}(model) are not DDP's on "
                   f"{ranks_phrase(wrong)} (largest difference {gap:.3g}; allowed 1e-9).",
                   hint="after backward(), every rank must hold the mean of all ranks' gradients, "
                        "in p.grad itself.")


@checker
def average_gradients(lab: Any = None, timeout: float = _TIMEOUT) -> None:
    """Check ``average_gradients(model)``: after it, every ``p.grad`` is the mean over ranks, as DDP's."""
    got = _run("average_gradients", lab, timeout)
    _same_as_ddp("average_gradients", got, lab.world_size, lab, timeout)
    passed(f"{_STEPS} steps with average_gradients(model) end on DDP's weights, on every rank.")


@checker
def average_gradients_flat(lab: Any = None, timeout: float = _TIMEOUT) -> None:
    """Check ``average_gradients_flat(model)``: DDP's weights, with fewer all_reduces than parameters."""
    n = lab.world_size
    got = _run("average_gradients_flat", lab, timeout)
    _same_as_ddp("average_gradients_flat", got, n, lab, timeout)
    params = got[0]["params"]
    many = [rank for rank, g in enumerate(got) if not 0 <= g["calls"] < params]
    if many:
        raise Feedback(f"{_times(got[many[0]]['calls'])} all_reduce calls per step on "
                       f"{ranks_phrase(many)}: no fewer than the model's {params} parameters, so "
                       f"the gradients were not reduced as one flat tensor.",
                       hint="put every gradient into one tensor, all_reduce that once, then copy "
                            "the pieces back into p.grad.")
    passed(f"one flat all_reduce per step gives DDP's weights after {_STEPS} steps, on every rank.")
