"""Checkers for notebook 04 (sampler sharding); see _core for the shared behaviour.

Each computes the expected answer on the ranks with torch's own
``DistributedSampler`` (and ``all_gather_object`` across ranks), never from a
stored answer.

    ddplab.check.offset_sharder(my_shard)   # = DistributedSampler(shuffle=False, drop_last=True)
    ddplab.check.epoch_orders()             # the variable `orders`: a new shuffle every epoch
    ddplab.check.rank_share(rank_share)     # per-rank count, padding and dropped samples
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import compare, run_on_ranks, passed, values_on_ranks

__all__ = ["epoch_orders", "offset_sharder", "rank_share"]

#: Dataset sizes the checks try: even, uneven both ways, and smaller than the world.
SIZES = (12, 10, 11, 7, 1)
#: The set_epoch exercise: its dataset size, epochs and seed (the exercise cell uses these).
ORDERS_N, ORDERS_EPOCHS, ORDERS_SEED = 12, 3, 0


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
def _reference_orders() -> list[list[int]]:
    sampler = _sampler(ORDERS_N, shuffle=True, seed=ORDERS_SEED)
    orders = []
    for epoch in range(ORDERS_EPOCHS):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def epoch_orders(lab: Any = None) -> None:
    """Check the ranks' ``orders``: each epoch's indices, with set_epoch called every epoch."""
    got = values_on_ranks("orders", lab)
    expected = run_on_ranks(_reference_orders, lab=lab)
    got = [[list(map(int, epoch)) for epoch in g] if isinstance(g, (list, tuple)) else g
           for g in got]
    repeats = [g for g in got if isinstance(g, list) and len(g) > 1 and all(e == g[0] for e in g)]
    if repeats and all(r[0] == sorted(r[0]) for r in repeats):
        hint = "the indices come in order, unshuffled: the sampler needs shuffle=True."
    elif repeats:
        hint = "every epoch has the same order: call sampler.set_epoch(epoch) at the start of each epoch."
    else:
        hint = (f"use DistributedSampler(list(range({ORDERS_N})), shuffle=True, seed={ORDERS_SEED}) "
                f"and call sampler.set_epoch(epoch) before each epoch.")
    compare(f"orders (the indices of each of {ORDERS_EPOCHS} epochs)", expected, got, hint=hint)
    passed("a new shuffle every epoch, exactly as DistributedSampler gives it with set_epoch.")


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
