"""Checkers for notebook 04 (sampler sharding); see _core for the shared behaviour.

Each computes the expected answer on the ranks with torch's own
``DistributedSampler`` (and ``all_gather_object`` across ranks), never from a
stored answer.

    ddplab.check.offset_sharder(my_shard)   # = DistributedSampler(shuffle=False, drop_last=True)
    ddplab.check.epoch_orders()             # `orders`: epochs 5, 6, 7 of a resumed run, as uninterrupted
    ddplab.check.rank_share(rank_share)     # per-rank count, padding and dropped samples
    ddplab.check.line_shards()              # the class `LineShards`: a text file by rank and worker
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import compare, passed, run_on_ranks, values_on_ranks

__all__ = ["epoch_orders", "line_shards", "offset_sharder", "rank_share"]

#: Dataset sizes the checks try: even, uneven both ways, and smaller than the world.
SIZES = (12, 10, 11, 7, 1)
#: The set_epoch exercise: its dataset size, epochs and seed (the exercise cell uses these).
#: The run resumes at ORDERS_START: it must see what epochs 5, 6, 7 of an uninterrupted run saw.
ORDERS_N, ORDERS_EPOCHS, ORDERS_SEED, ORDERS_START = 12, 3, 0, 5


def _sampler(n: int, **kwargs):
    """On a rank: torch's DistributedSampler over a dataset of ``n`` samples (0..n-1)."""
    from torch.utils.data import DistributedSampler
    return DistributedSampler(range(n), **kwargs)      # rank, world size from the group


# ---------------------------------------------------------------- offset_sharder
def _offset_answers(fn: Callable) -> tuple[list, list]:
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = [list(_sampler(n, shuffle=False, drop_last=True)) for n in SIZES]
    got = [[int(i) for i in fn(n, rank, world_size)] for n in SIZES]
    return expected, got


def offset_sharder(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(n, rank, world_size)`` against DistributedSampler(shuffle=False, drop_last=True)."""
    answers = run_on_ranks(_offset_answers, fn, lab=lab)
    compare(f"my_shard(n, rank, world_size) for n in {list(SIZES)}",
            [e for e, _ in answers], [g for _, g in answers],
            hint="start at offset `rank`, step by `world_size`, and stop before the last "
                 "n % world_size samples, which drop_last=True drops.")
    passed("your sharder gives every rank exactly DistributedSampler's indices "
           "(shuffle=False, drop_last=True).")


# ------------------------------------------------------------------ epoch_orders
def _reference_orders(start: int = ORDERS_START) -> list[list[int]]:
    sampler = _sampler(ORDERS_N, shuffle=True, seed=ORDERS_SEED)
    orders = []
    for epoch in range(start, start + ORDERS_EPOCHS):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def epoch_orders(lab: Any = None) -> None:
    """Check the ranks' ``orders``: epochs 5, 6 and 7 of a run resumed at epoch 5.

    Each must be the order an uninterrupted run gave in that epoch: set_epoch
    with the true epoch number, not the count since the restart.
    """
    got = values_on_ranks("orders", lab)
    expected = run_on_ranks(_reference_orders, lab=lab)
    from_zero = run_on_ranks(_reference_orders, 0, lab=lab)
    got = [[list(map(int, epoch)) for epoch in g] if isinstance(g, (list, tuple)) else g
           for g in got]
    repeats = [g for g in got if isinstance(g, list) and len(g) > 1 and all(e == g[0] for e in g)]
    last = ORDERS_START + ORDERS_EPOCHS - 1
    if got == from_zero:
        hint = (f"these are the orders of epochs 0-{ORDERS_EPOCHS - 1}, which the run saw before it "
                f"stopped: after resuming, call sampler.set_epoch with the true epoch number "
                f"({ORDERS_START}..{last}), not the count since the restart.")
    elif repeats and all(r[0] == sorted(r[0]) for r in repeats):
        hint = "the indices come in order, unshuffled: the sampler needs shuffle=True."
    elif repeats:
        hint = "every epoch has the same order: call sampler.set_epoch(epoch) at the start of each epoch."
    else:
        hint = (f"use DistributedSampler(list(range({ORDERS_N})), shuffle=True, seed={ORDERS_SEED}) "
                f"and call sampler.set_epoch(epoch) for epoch {ORDERS_START}..{last}.")
    compare(f"orders (the indices of epochs {ORDERS_START}..{last})", expected, got, hint=hint)
    passed(f"epochs {ORDERS_START}..{last} of the resumed run see exactly the orders of an "
           f"uninterrupted run.")


# -------------------------------------------------------------------- rank_share
def _share_answers(fn: Callable) -> tuple[list, list]:
    import torch.distributed as dist
    world_size = dist.get_world_size()
    expected, got = [], []
    for n in SIZES:
        for drop_last in (False, True):
            mine = list(_sampler(n, shuffle=True, drop_last=drop_last))
            everyone = [None] * world_size
            dist.all_gather_object(everyone, mine)        # every rank's shard, on every rank
            seen = [i for shard in everyone for i in shard]
            expected.append((len(mine), len(seen) - len(set(seen)), n - len(set(seen))))
            answer = fn(n, world_size, drop_last)
            got.append(tuple(answer) if isinstance(answer, (list, tuple)) else answer)
    return expected, got


def rank_share(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(n, world_size, drop_last)`` -> ``(per_rank, padded, dropped)`` on every rank."""
    answers = run_on_ranks(_share_answers, fn, lab=lab)
    cases = [f"(n={n}, drop_last={d})" for n in SIZES for d in (False, True)]
    compare(f"rank_share for {', '.join(cases)}", [e for e, _ in answers],
            [g for _, g in answers],
            hint="drop_last=False pads every rank up to ceil(n / world_size) with repeated "
                 "samples; drop_last=True cuts every rank down to n // world_size.")
    passed("every rank's share, the padding and the dropped samples match DistributedSampler.")


# ------------------------------------------------------------------ line_shards
#: The text file line_shards reads: LINES lines, "line 0" .. "line 22" (23: prime, uneven everywhere).
LINES = 23
#: DataLoader worker counts it tries; None is num_workers=0 (get_worker_info() returns None).
WORKERS = (None, 2, 3)


def _line_shard_answers(name: str) -> Any:
    """On a rank: what the student's IterableDataset yields in each worker, for each worker count."""
    import os
    import tempfile
    import types

    import torch.distributed as dist
    import torch.utils.data as tud

    from ddplab.rank.engine import namespace

    cls = namespace().get(name)
    if not callable(cls):
        return "<no such class on this rank>"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = tempfile.mkdtemp(prefix="ddplab-lines-")
    path = os.path.join(folder, "lines.txt")
    with open(path, "w") as f:
        f.write("".join(f"line {i}\n" for i in range(LINES)))
    real = tud.get_worker_info
    ns = namespace()
    bound = ns.get("get_worker_info") is real         # `from torch.utils.data import get_worker_info`
    expected, got = [], []
    try:
        for workers in WORKERS:
            for worker in range(workers or 1):
                info = None if workers is None else types.SimpleNamespace(
                    id=worker, num_workers=workers, seed=0, dataset=None)
                tud.get_worker_info = lambda info=info: info
                if bound:
                    ns["get_worker_info"] = tud.get_worker_info
                k = workers or 1
                expected.append([f"line {i}" for i in range(LINES)
                                 if i % (world_size * k) == rank * k + worker])
                got.append([str(line).rstrip("\n") for line in cls(path)])
    finally:
        tud.get_worker_info = real
        if bound:
            ns["get_worker_info"] = real
        os.remove(path)
        os.rmdir(folder)
    return {"expected": expected, "got": got}


def line_shards(lab: Any = None) -> None:
    """Check ``LineShards(path)``: this rank's and this DataLoader worker's lines of a text file.

    Line i belongs to rank r's worker w of k when ``i % (world_size * k) == r * k + w``;
    with no workers (``get_worker_info()`` is None) k is 1 and w is 0. The checker
    gives it a 23-line file and plays 0, 2 and 3 workers on every rank.
    """
    got = run_on_ranks(_line_shard_answers, "LineShards", lab=lab)
    from ._core import require_function
    require_function(got, "LineShards", "<no such class on this rank>", kind="class")
    compare(f"the lines LineShards yields per worker, for num_workers in {[w or 0 for w in WORKERS]}",
            [g["expected"] for g in got], [g["got"] for g in got],
            hint="in __iter__, ask torch.utils.data.get_worker_info(): None means one worker (id 0 of 1); "
                 "keep line i when i % (world_size * num_workers) == rank * num_workers + worker id, "
                 "and strip the newline.")
    passed("every rank and every DataLoader worker reads its own lines, and together they read "
           "each line once.")
