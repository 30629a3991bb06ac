"""Checkers of notebook 09 (debugging distributed training): the bug zoo.

Each exercise hands the student a function with one common distributed bug;
the student finds it with a tool and fixes it. The checker judges what the
fixed function *does*, never its text: it runs it on every rank with inputs of
its own, under a short timeout (a hang fails the check within seconds), and
compares with what one process computes (the mean by hand, the model trained
on the whole batch, DDP with join replayed step by step, ``DistributedSampler``'s
own order). Where a do-nothing answer would pass a comparison (equal weights
on every rank come free from DDP's first broadcast; a divisor written in the
code is right for one world size), the checker also looks at what the code
used: which batches a forward pass saw, and the mean in a world of one rank.
"""

from __future__ import annotations

from typing import Any

from ._core import compare, passed, run_student_code, same, warm_up_ddp

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
#: Rank r holds 3 + 2r batches: rank 1 two more than rank 0.
def _batch_counts(world: int) -> list[int]:
    return [3 + 2 * rank for rank in range(world)]


def _batches(rank: int, count: int) -> list:
    """Rank ``rank``'s ``(x, y)`` batches, the same wherever they are made."""
    import torch
    generator = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))
            for _ in range(count)]


def _joined_reference(world: int, by_initial_world: bool) -> list[float]:
    """The weights DDP + join ends with, computed in one process.

    At each step, every rank that still holds a batch adds its gradient and a
    rank that ran out adds zeros (join's shadowing); the sum is divided by the
    world size (``model.join()``'s default) or by the ranks still training
    (``divide_by_initial_world_size=False``). One SGD step of lr 0.1 per step.
    """
    import torch
    import torch.nn.functional as F
    counts = _batch_counts(world)
    batches = [_batches(rank, count) for rank, count in enumerate(counts)]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    params = [p.detach().clone() for p in model.parameters()]
    for step in range(max(counts)):
        active = [rank for rank in range(world) if step < counts[rank]]
        total = [torch.zeros_like(p) for p in params]
        for rank in active:
            x, y = batches[rank][step]
            weight, bias = (p.clone().requires_grad_() for p in params)
            loss = F.mse_loss(x @ weight.T + bias, y)
            for t, g in zip(total, torch.autograd.grad(loss, [weight, bias])):
                t += g
        divisor = world if by_initial_world else len(active)
        params = [p - 0.1 * t / divisor for p, t in zip(params, total)]
    return [round(v, 5) for p in params for v in p.flatten().tolist()]


def _uneven() -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(rank, _batch_counts(world)[rank])
    used: set[int] = set()

    def note(module, args):          # which of this rank's batches a forward pass saw
        x = args[0] if args else None
        used.update(i for i, (bx, _) in enumerate(batches)
                    if isinstance(x, torch.Tensor) and x.shape == bx.shape and torch.equal(x, bx))
    hook = model.module.register_forward_pre_hook(note)
    try:
        _student("train_uneven")(model, optimizer, list(batches))
    finally:
        hook.remove()
    return {"used": len(used), "held": len(batches),
            "weights": [round(v, 5) for p in model.module.parameters()
                        for v in p.detach().flatten().tolist()],
            "references": [_joined_reference(world, True), _joined_reference(world, False)]}


def uneven_batches(lab: Any = None) -> None:
    """``train_uneven`` trains ranks that hold different numbers of batches, with no hang, on
    every batch of every rank: the weights DDP with join computes (one process replays it)."""
    __tracebackhide__ = True
    warm_up_ddp(lab)                   # a fresh rank's first DDP step is slow, not stuck
    got = run_student_code("train_uneven(model, optimizer, batches)", _uneven, lab=lab,
                           timeout=TIMEOUT,
                           hint="the rank with more batches runs a backward() whose all_reduce "
                                "the others never join: train inside `with model.join():`.")
    short = [(rank, g) for rank, g in enumerate(got) if g["used"] < g["held"]]
    if short and all(g["used"] == 0 for g in got):
        raise AssertionError(
            "train_uneven trained on none of its batches: no forward pass saw one, on any rank. "
            "Equal weights on every rank prove nothing then (DDP copies rank 0's weights at the "
            "start). Take one SGD step per (x, y) batch, inside `with model.join():`.")
    if short:
        which = ", ".join(f"rank {rank} on {g['used']} of its {g['held']} batches" for rank, g in short)
        raise AssertionError(
            f"train_uneven skipped batches: it trained {which}. Every batch of every rank must "
            f"train; stopping every rank at the shortest rank's count throws the others' last "
            f"batches away. Inside `with model.join():` a rank that ran out shadows the others' "
            f"extra steps instead.")
    references = got[0]["references"]
    if any(all(same(ref, g["weights"], atol=2e-5) for g in got) for ref in references):
        held = [str(g["held"]) for g in got]
        passed(f"ranks with {', '.join(held[:-1])} and {held[-1]} batches trained on every "
               f"batch and finished together, on the weights DDP with join computes.")
        return
    compare("the weights after train_uneven (replayed in one process: each step averages the "
            "gradients of the ranks that still hold a batch)", [references[0]] * len(got),
            [g["weights"] for g in got], atol=2e-5,
            hint="one optimizer.step() per batch, the MSE loss, the learning rate as given; a "
                 "rank that ran out adds zeros to the others' steps (model.join()).")


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
    warm_up_ddp(lab)
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
    import shutil
    import tempfile

    from ._core import lab_or_current
    __tracebackhide__ = True
    lab = lab_or_current(lab)
    warm_up_ddp(lab)
    folder = tempfile.mkdtemp(prefix="ddplab-ckpt-")
    try:          # removed however the check ends: a failed answer too
        path = os.path.join(folder, "model.pt")
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
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    passed("one checkpoint, written by rank 0, loads into a plain model on every rank.")


# ----------------------------------------------------- 6: averaging with the wrong world size
def _average() -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1), 10.0])
    return [round(float(v), 6) for v in _student("average")(t)]


def _average_alone() -> list[float]:
    """``average(t)`` in a world of one rank: the lab's group set aside, a group of 1 made.

    The rank's ``rank`` and ``world_size`` variables say so while it runs, as
    they would on a lab of one rank: only a number written in the code differs.
    """
    import torch
    import torch.distributed as dist

    from ddplab.rank import owngroup
    from ddplab.rank.engine import namespace
    average, ns = _student("average"), namespace()
    t = torch.tensor([float(dist.get_rank() + 1), 10.0])
    saved = {name: ns[name] for name in ("rank", "world_size") if name in ns}
    with owngroup.set_aside():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ns.update(rank=0, world_size=1)
        try:
            return [round(float(v), 6) for v in average(t)]
        finally:
            ns.update(saved)


def _divisor(total: float, got: float) -> str:
    """The number ``got = total / divisor`` was divided by, spelled, or "" if it is no round one."""
    if not got:
        return ""
    divisor = total / got
    return f"{round(divisor):d}" if abs(divisor - round(divisor)) < 1e-4 else ""


def _hard_coded(where: str, size: int, total: float, got: list[list[float]]) -> None:
    """Raise naming the divisor if every rank divided ``total`` by one number other than ``size``."""
    divisors = {_divisor(total, g[1]) for g in got}
    if len(divisors) != 1 or "" in divisors or divisors == {str(size)}:
        return
    (divisor,) = divisors
    if divisor == "1":
        raise AssertionError(f"average(t) returned the sum, not the mean, {where}: divide the "
                             f"all_reduced sum by dist.get_world_size().")
    raise AssertionError(
        f"average(t) divides the sum by {divisor} {where}, where the mean divides by {size}: a "
        f"number written in the code is right for one world size only. Divide by "
        f"dist.get_world_size(), the size of the group the all_reduce summed over.")


def world_size_mean(lab: Any = None) -> None:
    """``average(t)`` returns the mean over ranks, for any number of ranks: on the lab's ranks,
    and on each rank alone in a world of one."""
    __tracebackhide__ = True
    got = run_student_code("average(t)", _average, lab=lab, timeout=TIMEOUT,
                           hint="every rank must call the all_reduce.")
    n = len(got)
    _hard_coded(f"on the lab's {n} ranks", n, 10.0 * n, got)
    compare("average([rank + 1, 10])", [[round((n + 1) / 2, 6), 10.0]] * n, got, atol=1e-6,
            hint="all_reduce the tensor, then divide the sum by dist.get_world_size().")
    alone = run_student_code("average(t) in a world of 1 rank", _average_alone, lab=lab,
                             timeout=TIMEOUT, hint="")
    _hard_coded("in a world of 1 rank", 1, 10.0, alone)
    compare("average([rank + 1, 10]) in a world of 1 rank (the mean of one tensor is itself)",
            [[float(r + 1), 10.0] for r in range(n)], alone, atol=1e-6,
            hint="divide by dist.get_world_size(), never by a number written in the code.")
    passed(f"average(t) is the mean over the {n} ranks, and over 1 rank alone.")


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
