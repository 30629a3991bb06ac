"""Checkers of notebook 09 (debugging distributed training): the bug zoo.

Each exercise hands the student a function with one common distributed bug;
the student finds it with a tool and fixes it. The checker judges what the
fixed function *does*, never its text: it runs it on every rank with inputs of
its own, under a short timeout (a hang fails the check within seconds), and
compares with what one process computes (the mean by hand, the model trained
on the whole batch, ``DistributedSampler``'s own order).
"""

from __future__ import annotations

from typing import Any

from ._core import compare, passed, run_student_code

__all__ = ["checkpoint_once", "mean_loss", "no_unused_parameters", "padded_gather",
           "shuffled_each_epoch", "two_heads", "uneven_batches", "world_size_mean"]

#: Seconds a fixed function gets; the broken ones hang, and this is how long until we say so.
TIMEOUT = 10.0


def _student(name: str) -> Any:
    """On a rank: the student's function ``name`` from the rank's namespace."""
    from ddplab.rank.engine import namespace
    fn = namespace().get(name)
    if fn is None:
        raise NameError(f"no function `{name}` on this rank: run the exercise cell (%%ranks) above")
    return fn


# ----------------------------------------------------------- 1: a rank skips a collective
def _mean_loss() -> float:
    import torch
    import torch.distributed as dist
    return float(_student("mean_loss")(torch.tensor(float(dist.get_rank() + 1))))


def mean_loss(lab: Any = None) -> None:
    """``mean_loss(loss)`` returns the mean of every rank's loss, on every rank, without hanging."""
    __tracebackhide__ = True
    got = run_student_code("mean_loss(loss)", _mean_loss, lab=lab, timeout=TIMEOUT,
                           hint="a rank skipped the all_reduce: every rank must call a collective, "
                                "not only rank 0 (keep `if rank == 0:` for the print alone).")
    n = len(got)
    compare("mean_loss(rank + 1)", [(n + 1) / 2] * n, got, atol=1e-6,
            hint="all_reduce sums; divide by the number of ranks for the mean.")
    passed(f"every rank called the all_reduce and got the mean loss {(n + 1) / 2:g}.")


# ------------------------------------------------------- 2: uneven batches hang backward
def _uneven() -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))
               for _ in range(3 + 2 * rank)]          # rank 1 has two batches more than rank 0
    _student("train_uneven")(model, optimizer, batches)
    return [round(v, 5) for v in model.module.weight.detach().flatten().tolist()]


def uneven_batches(lab: Any = None) -> None:
    """``train_uneven`` trains ranks that hold different numbers of batches, with no hang, and
    ends with the same weights on every rank."""
    __tracebackhide__ = True
    got = run_student_code("train_uneven(model, optimizer, batches)", _uneven, lab=lab,
                           timeout=TIMEOUT,
                           hint="the rank with more batches runs a backward() whose all_reduce "
                                "the others never join: train inside `with model.join():`.")
    compare("the weights after train_uneven", [got[0]] * len(got), got, atol=1e-5,
            hint="every rank must end with the same weights (DDP keeps them equal).")
    passed("ranks with 3 and 5 batches finished together, with the same weights.")


# ------------------------------------------------------------- 3: an unused parameter
def two_heads() -> Any:
    """A small model whose ``aux`` head is never used in ``forward``: DDP waits for its gradient."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 1)
            self.aux = torch.nn.Linear(4, 1)        # left over from an experiment

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    torch.manual_seed(0)
    return Model()


def _unused(steps: int = 3) -> dict:
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8 * world, 4, generator=generator), torch.randn(8 * world, 1, generator=generator)
    model = _student("wrap")(two_heads())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = two_heads()                        # one process, the whole batch
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    mine = slice(8 * rank, 8 * rank + 8)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
    inner = getattr(model, "module", model)
    return {"same": all(torch.allclose(a, b, atol=1e-5) for a, b in
                        zip(inner.state_dict().values(), reference.state_dict().values())),
            "ddp": type(model).__name__}


def no_unused_parameters(lab: Any = None) -> None:
    """``wrap(model)`` gives a DDP model that trains ``two_heads()`` like one process would."""
    __tracebackhide__ = True
    try:
        got = run_student_code("3 steps of wrap(two_heads())", _unused, lab=lab, timeout=TIMEOUT,
                               hint="")
    except AssertionError as exc:
        if "finished reduction in the prior iteration" in str(exc):
            raise AssertionError(
                "wrap(two_heads()) fails at its second step: DDP expected a gradient for every "
                "parameter, and `aux` never gets one (TORCH_DISTRIBUTED_DEBUG=DETAIL names it). "
                "Pass find_unused_parameters=True, or leave the unused head out.") from None
        raise
    compare("wrap(model) is a DistributedDataParallel", ["DistributedDataParallel"] * len(got),
            [g["ddp"] for g in got], hint="return DDP(model, ...): the ranks must average gradients.")
    compare("weights equal one process trained on the whole batch", [True] * len(got),
            [g["same"] for g in got], hint="DDP averages the gradients of the ranks' shards.")
    passed("3 DDP steps with an unused head end on the weights of one process.")


# ---------------------------------------------------------- 4: a rank-dependent shape
def _gather() -> list[float]:
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    preds = torch.arange(3 + 2 * rank, dtype=torch.float32) + 10 * rank   # 3 on rank 0, 5 on rank 1
    return [float(v) for v in _student("gather_predictions")(preds)]


def padded_gather(lab: Any = None) -> None:
    """``gather_predictions(preds)`` gathers predictions of different lengths, in rank order."""
    __tracebackhide__ = True
    got = run_student_code("gather_predictions(preds)", _gather, lab=lab, timeout=TIMEOUT,
                           hint="all_gather needs tensors of one shape on every rank: pad to the "
                                "longest length (all_reduce it with MAX), gather, then cut.")
    expected = [float(10 * r + i) for r in range(len(got)) for i in range(3 + 2 * r)]
    compare("gather_predictions: every rank's predictions, in rank order", [expected] * len(got),
            got, hint="cut each rank's padding off: keep its own length, not the longest.")
    passed(f"{len(expected)} predictions of uneven lengths gathered on every rank.")


# ------------------------------------------------------- 5: a checkpoint written once
def _save(path: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.train import SmallCNN
    torch.manual_seed(0)
    model = DDP(SmallCNN())
    saves, real = [], torch.save

    def counted(*args, **kwargs):
        saves.append(1)
        return real(*args, **kwargs)
    torch.save = counted
    try:
        _student("save_checkpoint")(model, path)
    finally:
        torch.save = real
    dist.barrier()
    return len(saves)


def _load(path: str) -> str:
    import torch

    from ddplab.train import SmallCNN
    torch.manual_seed(0)
    expected = SmallCNN().state_dict()
    model = _student("load_checkpoint")(path)
    if type(model).__name__ != "SmallCNN":
        return f"a {type(model).__name__}, not the plain SmallCNN"
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.values()))
    return "ok" if same else "other weights than the saved ones"


def checkpoint_once(lab: Any = None) -> None:
    """``save_checkpoint`` writes one file, from rank 0; ``load_checkpoint`` reads it into a
    plain model (no ``module.`` prefix)."""
    import os
    import tempfile

    from ._core import lab_or_current
    __tracebackhide__ = True
    lab = lab_or_current(lab)
    path = os.path.join(tempfile.mkdtemp(prefix="ddplab-ckpt-"), "model.pt")
    saves = run_student_code("save_checkpoint(model, path)", _save, path, lab=lab,
                             timeout=TIMEOUT, hint="")
    compare("torch.save calls per rank", [1] + [0] * (len(saves) - 1), saves,
            hint="every rank holds the same weights: write them once, on rank 0 "
                 "(`if rank == 0:`), or the ranks write one file over each other.")
    try:
        got = run_student_code("load_checkpoint(path)", _load, path, lab=lab, timeout=TIMEOUT,
                               hint="")
    except AssertionError as exc:
        if 'Unexpected key(s) in state_dict: "module.' in str(exc):
            raise AssertionError(
                "load_checkpoint(path): the saved keys start with 'module.' (DDP's own state_dict), "
                "and the plain SmallCNN refuses them. Save ddp_model.module.state_dict().") from None
        raise
    compare("load_checkpoint(path) gives the saved weights in a plain SmallCNN",
            ["ok"] * len(got), got,
            hint="save ddp_model.module.state_dict(): DDP's own keys start with 'module.'.")
    passed("one checkpoint, written by rank 0, loads into a plain model on every rank.")


# ----------------------------------------------------- 6: averaging with the wrong world size
def _average() -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1), 10.0])
    return [round(float(v), 6) for v in _student("average")(t)]


def world_size_mean(lab: Any = None) -> None:
    """``average(t)`` returns the mean over ranks, for any number of ranks."""
    __tracebackhide__ = True
    got = run_student_code("average(t)", _average, lab=lab, timeout=TIMEOUT,
                           hint="every rank must call the all_reduce.")
    n = len(got)
    compare("average([rank + 1, 10])", [[round((n + 1) / 2, 6), 10.0]] * n, got, atol=1e-6,
            hint="divide the sum by dist.get_world_size(), never by a number written in "
                 "the code: the lab here has a different number of ranks.")
    passed(f"average(t) is the mean over the {n} ranks.")


# ------------------------------------------------------------- 7: set_epoch missing
def _orders() -> dict:
    from torch.utils.data import DistributedSampler
    data = list(range(16))
    got = _student("epoch_orders")(data, 2)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expected.append(list(sampler))
    return {"got": [list(map(int, o)) for o in got], "expected": expected}


def shuffled_each_epoch(lab: Any = None) -> None:
    """``epoch_orders(data, epochs)`` gives each epoch its own shuffled order, like torch does."""
    __tracebackhide__ = True
    got = run_student_code("epoch_orders(data, 2)", _orders, lab=lab, timeout=TIMEOUT, hint="")
    repeats = [rank for rank, g in enumerate(got) if len(g["got"]) == 2 and g["got"][0] == g["got"][1]]
    if repeats:
        raise AssertionError(f"epoch 1 repeats epoch 0's order on ranks {', '.join(map(str, repeats))}: "
                             f"the sampler shuffles with seed + epoch, and the epoch stays 0. "
                             f"Call sampler.set_epoch(epoch) at the start of each epoch.")
    compare("each epoch's indices on this rank", [g["expected"] for g in got],
            [g["got"] for g in got], hint="use DistributedSampler(data, shuffle=True) and "
                                          "set_epoch(epoch) before each epoch's loop.")
    passed("each epoch has its own order, and the ranks still split the data between them.")
