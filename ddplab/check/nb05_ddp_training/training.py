"""Checkers for notebook 05, DDP training.

- ``wrap_model()``: the variable ``ddp_model`` on each rank is a
  ``DistributedDataParallel`` around that rank's ``model``, placed as the
  backend wants (``device_ids=None`` on CPU, ``[its GPU]`` under nccl), and
  holding rank 0's weights on every rank.
- ``epoch_loader()``: the function ``epoch_loader(dataset, batch_size, epoch)``
  gives each rank its own shard of the data, together covering all of it,
  shuffled anew each epoch.
- ``global_accuracy()``: ``global_accuracy(correct, total)`` is the accuracy
  over every rank's samples, the same on every rank.
- ``save_checkpoint()``: ``save_checkpoint(model, path)`` writes the model's
  weights once, from rank 0 only, loadable into a plain model, and no rank
  returns before the file is there.
- ``train_uneven()``: ``train_uneven(ddp_model, optimizer, batches)`` trains on
  every one of this rank's batches, when the ranks have different numbers of
  them, without a deadlock, and ends with the weights of a ``Join``-ed loop.

Each checker calls the student's code on the ranks with inputs it made
itself, and computes what is right in the kernel, independently of it. The
tables show expected values: facts of the run (rank 0's weights, a count of
saves, the accuracy of counts the check drew), never a value to copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from ...lab.diagnose import DDP_IS_A_COLLECTIVE
from .._core import (
    MISSING,
    checker,
    compare,
    holds,
    is_missing,
    passed,
    require_function,
    run_student_code,
    run_student_function,
    warm_up_ddp,
)
from .._feedback import Feedback, Row, ranks_phrase

__all__ = ["epoch_loader", "global_accuracy", "save_checkpoint", "train_uneven", "wrap_model"]

_TIMEOUT = 15.0            # each of these exercises takes about a second: longer is a deadlock
#: The dataset the sampler checker hands to ``epoch_loader``: sample i is the number i.
#: 24 splits evenly over 1, 2, 3, 4, 6, 8 and 12 ranks, so no rank gets padding.
_SAMPLES = 24


def _student(name: str, lab: Any, fn, *args: Any) -> list[Any]:
    """Run ``fn(student_function, *args)`` on every rank; every failure becomes a ``Feedback``."""
    warm_up_ddp(lab)
    return run_student_function(name, fn, *args, lab=lab, timeout=_TIMEOUT,
                                hint="every rank must make the same collective calls, a barrier "
                                     "included.")


# ----------------------------------------------------------------- wrap_model
#: Reading ``ddp_model`` takes milliseconds; a rank busy longer is stuck in DDP's constructor.
_WRAP_TIMEOUT = 15.0
_DDP_IS_A_COLLECTIVE = DDP_IS_A_COLLECTIVE


def _describe_wrapping() -> dict:
    """On a rank: what ``ddp_model`` is, and a fingerprint of its weights."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ddplab.rank.engine import namespace
    from ddplab.train import device_for_this_rank

    ns = namespace()
    if "ddp_model" not in ns:
        return MISSING
    wrapped, model = ns.get("ddp_model"), ns.get("model")
    device = device_for_this_rank()
    ddp = isinstance(wrapped, DistributedDataParallel)
    inner = wrapped.module if ddp else wrapped
    params = list(inner.parameters()) if isinstance(inner, torch.nn.Module) else []
    flat = torch.cat([p.detach().double().flatten().cpu() for p in params]) if params else torch.zeros(0)
    return {"type": type(wrapped).__name__, "wraps_model": ddp and wrapped.module is model,
            "device_ids": wrapped.device_ids if ddp else None,
            "expected_device_ids": [device.index] if device.type == "cuda" else None,
            "first": flat[:6].float(), "all": flat}


@checker
def wrap_model(lab: Any = None) -> None:
    """Check ``ddp_model``: ``model`` wrapped in DDP, placed right, with rank 0's weights everywhere."""
    import torch

    n = lab.world_size
    got = run_student_code("reading ddp_model", _describe_wrapping, lab=lab, timeout=_WRAP_TIMEOUT,
                           hint="construct DDP(model) on every rank at once.")
    missing = [rank for rank, g in enumerate(got) if is_missing(g)]
    if missing and len(missing) < n:
        has = [rank for rank in range(n) if rank not in missing]
        raise Feedback(f"ddp_model exists on {ranks_phrase(has)} but not on {ranks_phrase(missing)}: "
                       f"DDP was constructed on some ranks only.",
                       hint=f"{_DDP_IS_A_COLLECTIVE} If a rank is stuck, lab.restart() first.")
    require_function(got, "ddp_model", kind="variable", verb="makes")
    compare("type(ddp_model).__name__", ["DistributedDataParallel"] * n, [g["type"] for g in got],
            hint="wrap the model in torch's DistributedDataParallel (torch.nn.parallel).")
    holds("ddp_model.module is model", [g["wraps_model"] for g in got],
          hint="wrap this rank's own `model`, the one the cells above built.")
    compare("ddp_model.device_ids", [g["expected_device_ids"] for g in got],
            [g["device_ids"] for g in got],
            hint="on a GPU: device_ids=[the rank's GPU index]; on CPU leave device_ids out (None).")
    # DDP's constructor broadcasts rank 0's weights: every rank must now hold them.
    compare("the first weights of ddp_model", [got[0]["first"]] * n, [g["first"] for g in got],
            hint="construct DDP on every rank (a %%ranks cell), and do not change the weights "
                 "afterwards on one rank only.")
    equal = [bool(torch.equal(g["all"], got[0]["all"])) for g in got]
    holds("all weights equal rank 0's", equal,
          hint="the weights must be exactly rank 0's on every rank, as DDP's broadcast leaves them.")
    passed("ddp_model wraps model in DDP, and every rank holds rank 0's weights.")


# --------------------------------------------------------------- epoch_loader
def _loader_indices(student, samples: int, batch_size: int) -> dict:
    """On a rank: the sample numbers ``epoch_loader`` yields in epochs 0 and 1, and its batch sizes."""
    import torch
    from torch.utils.data import TensorDataset

    dataset = TensorDataset(torch.arange(samples))
    seen, sizes = [], []
    for epoch in (0, 1):
        order = []
        for batch in student(dataset, batch_size, epoch):
            values = batch[0] if isinstance(batch, (list, tuple)) else batch
            order += [int(v) for v in values.reshape(-1)]
            sizes.append(len(values))
        seen.append(order)
    return {"epochs": seen, "largest_batch": max(sizes, default=0)}


@checker
def epoch_loader(lab: Any = None) -> None:
    """Check ``epoch_loader(dataset, batch_size, epoch)``: disjoint shards, all data, new order each epoch."""
    n, batch_size = lab.world_size, 4
    got = _student("epoch_loader", lab, _loader_indices, _SAMPLES, batch_size)
    what = f"epoch_loader(dataset of {_SAMPLES} samples, batch_size={batch_size}, epoch)"
    compare(f"{what}: samples per rank in epoch 0", [_SAMPLES // n] * n,
            [len(g["epochs"][0]) for g in got],
            hint="without a DistributedSampler every rank walks the whole dataset; the sampler "
                 "gives each rank its own shard (and does the shuffling: the DataLoader must not).")
    compare(f"{what}: largest batch", [batch_size] * n, [g["largest_batch"] for g in got],
            hint="pass batch_size on to the DataLoader.")
    for epoch in (0, 1):
        union = sorted(i for g in got for i in g["epochs"][epoch])
        if union != list(range(_SAMPLES)):
            raise Feedback(
                f"{what}: in epoch {epoch} the ranks' shards are not disjoint, or do not hold every "
                f"sample 0..{_SAMPLES - 1} once between them.",
                rows=[Row(rank, str(g["epochs"][epoch])) for rank, g in enumerate(got)],
                hint="every rank must use the same sampler seed, so that they shuffle alike and "
                     "split the same order.")
    holds(f"{what}: the order changes from epoch 0 to epoch 1",
          [g["epochs"][0] != g["epochs"][1] for g in got],
          hint="a DistributedSampler draws its order from its seed and the epoch it was told "
               "(set_epoch): without it, every epoch repeats the same order.")
    passed("each rank gets its own shard, the shards cover the data, and the order changes "
           "every epoch.")


# ------------------------------------------------------------ global_accuracy
def _call_accuracy(student, correct: int, total: int) -> Any:
    """On a rank: the student's answer for this rank's counts, sent to this rank alone."""
    answer = student(correct, total)
    return float(answer.item() if hasattr(answer, "item") else answer)


def _counts(n: int) -> list[tuple[list[int], list[int]]]:
    """Two trials of (correct, total) per rank, drawn now from a seed no rank sees.

    First: every rank a different number of samples, and accuracies whose mean
    is not the accuracy of all samples (the mistake it must catch). Then one
    rank with hits and the others with none, as the last shards of a test set.
    """
    import random
    import secrets

    draw = random.Random(secrets.randbits(62))
    while True:                        # until the mean of the accuracies is not the answer
        total = [10 * (r + 1) + draw.randint(0, 9) for r in range(n)]
        correct = [draw.randint(1, t - 1) for t in total]
        if abs(sum(c / t for c, t in zip(correct, total)) / n - sum(correct) / sum(total)) > 1e-3:
            break
    hits = draw.randint(1, 8)
    return [(correct, total), ([hits] + [0] * (n - 1), [8] * n)]


@checker
def global_accuracy(lab: Any = None) -> None:
    """Check ``global_accuracy(correct, total)``: sum of hits over sum of samples, on every rank."""
    n = lab.world_size
    # Ranks see different numbers of samples, as the last shard of a real test
    # set can: then the mean of the ranks' accuracies is not the accuracy.
    for correct, total in _counts(n):
        warm_up_ddp(lab)
        got = run_student_function("global_accuracy", _call_accuracy, lab=lab, timeout=_TIMEOUT,
                                   hint="every rank must make the same collective calls, a barrier "
                                        "included.",
                                   each={r: (correct[r], total[r]) for r in range(n)})
        expected = sum(correct) / sum(total)
        given = ", ".join(f"({c}, {t}) on rank {r}" for r, (c, t) in enumerate(zip(correct, total)))
        compare(f"global_accuracy(correct, total) with {given}", [expected] * n, got, atol=1e-9,
                hint="the accuracy of all samples is all hits over all samples: both counts must "
                     "be summed across the ranks before the division. Averaging the ranks' own "
                     "accuracies is wrong when they saw different numbers of samples.")
    passed("global_accuracy(correct, total) sums hits and samples over all ranks.")


# ------------------------------------------------------------ save_checkpoint
def _call_save(student, path: str, delay: float) -> dict:
    """On a rank: call ``save_checkpoint`` on a fresh DDP model, counting ``torch.save`` calls."""
    import time

    import torch
    import torch.distributed as dist

    from ddplab.train import SmallCNN, device_for_this_rank, wrap

    with torch.random.fork_rng(devices=[]):    # leave the student's random state alone
        torch.manual_seed(1234)
        model = wrap(SmallCNN(), device_for_this_rank())
    calls = []
    original = torch.save

    def counting_save(obj, f, *args, **kwargs):
        calls.append(dist.get_rank())
        time.sleep(delay)      # a slow disk: a rank that does not wait for rank 0 returns first
        return original(obj, f, *args, **kwargs)

    torch.save = counting_save
    try:
        student(model, path)
    finally:
        torch.save = original
    there = os.path.exists(path)
    dist.barrier()             # every rank has returned; now compare with the file
    loaded = ""
    try:
        fresh = SmallCNN()
        fresh.load_state_dict(torch.load(path, map_location="cpu"))
        same = all(torch.equal(a.cpu(), b) for a, b in
                   zip(model.module.state_dict().values(), fresh.state_dict().values()))
        loaded = "same weights" if same else "different weights"
    except Exception as exc:   # a missing file, or a state dict a plain model refuses
        loaded = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return {"saves": len(calls), "there": there, "loaded": loaded}


@checker
def save_checkpoint(lab: Any = None, delay: float = 1.0) -> None:
    """Check ``save_checkpoint(model, path)``: rank 0 alone writes; every rank waits for the file."""
    n = lab.world_size
    folder = tempfile.mkdtemp(prefix="ddplab-check-")
    try:
        path = os.path.join(folder, "checkpoint.pt")
        got = _student("save_checkpoint", lab, _call_save, path, delay)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    compare("torch.save calls during save_checkpoint(model, path)", [1] + [0] * (n - 1),
            [g["saves"] for g in got],
            hint="every rank holds the same weights, so one rank (rank 0) writes the file and "
                 "the others do not.")
    compare("a plain SmallCNN loading the file", ["same weights"] * n, [g["loaded"] for g in got],
            hint="save model.module.state_dict(): the weights of the model inside DDP, without "
                 "the 'module.' prefix, so a plain model can load them.")
    holds("the file exists when save_checkpoint returns", [g["there"] for g in got],
          hint="the other ranks must wait until rank 0 has written: every rank meets the others "
               "after the save.")
    passed("only rank 0 writes the checkpoint, a plain model loads it, and no rank returns early.")


# --------------------------------------------------------------- train_uneven
#: Seconds a train_uneven answer may take: the checker's loops are a few tiny steps,
#: so a rank still waiting after this waits for a rank that ran out of batches.
_UNEVEN_TIMEOUT = 20.0


def _uneven_batches(rank: int) -> list:
    """Rank ``rank``'s batches for the check: 2 + 2*rank of them, so no two ranks have as many."""
    import torch
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
            for _ in range(2 + 2 * rank)]


def _joined_loop(ddp_model, optimizer, batches) -> int:
    """The reference: one SGD step per batch inside ``Join``; the number of steps."""
    import torch
    from torch.distributed.algorithms import Join
    steps = 0
    with Join([ddp_model]):
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps


def _uneven_answers(student) -> dict:
    """On a rank: the student's loop and the reference, each from the same fresh DDP model."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.train import device_for_this_rank

    device = device_for_this_rank()
    ids = [device.index] if device.type == "cuda" else None
    batches = [(x.to(device), y.to(device)) for x, y in _uneven_batches(dist.get_rank())]
    results = {}
    # The reference first: after a student's loop that deadlocks, a rank that finished
    # must meet nothing more (a later collective there could pair with a stuck one).
    for who, loop in (("reference", _joined_loop), ("student", student)):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 1).to(device), device_ids=ids)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = loop(model, optimizer, batches)
        weights = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        results[who] = {"steps": steps, "weights": weights}
    return {"batches": len(batches), **results}


@checker
def train_uneven(lab: Any = None) -> None:
    """Check ``train_uneven(ddp_model, optimizer, batches)`` on ranks with 2, 4, 6, ... batches.

    Each rank must take one step per batch of its own (returning how many), the
    loop must end on every rank (no rank left waiting in DDP's all_reduce for a
    rank that ran out), and the weights must be those of the same loop inside
    ``torch.distributed.algorithms.Join``.
    """
    warm_up_ddp(lab)
    got = run_student_function(
        "train_uneven", _uneven_answers, lab=lab, timeout=_UNEVEN_TIMEOUT,
        hint="a rank that ran out of batches stopped calling backward(), and the others wait in "
             "DDP's all_reduce for it. torch.distributed.algorithms has a context manager that "
             "lets a rank that is done keep answering the others' all_reduces.")
    n = lab.world_size
    compare("steps taken, one per batch of the rank", [g["batches"] for g in got],
            [g["student"]["steps"] for g in got],
            hint="take one optimizer step per batch of this rank, all of them (cutting every rank "
                 "to the fewest batches avoids the deadlock but throws data away), and return "
                 "the number of steps.")
    compare("the weights after the loop", [g["reference"]["weights"] for g in got],
            [g["student"]["weights"] for g in got], atol=1e-6,
            hint="per batch: optimizer.zero_grad(), the loss "
                 "torch.nn.functional.mse_loss(ddp_model(x), y), backward(), optimizer.step().")
    passed(f"ranks with {', '.join(str(g['batches']) for g in got)} batches each trained on all "
           f"of theirs, and the {n} ranks ended with the same weights.")
