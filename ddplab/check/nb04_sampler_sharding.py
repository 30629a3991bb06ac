"""Checkers for notebook 04 (sampler sharding); see _core for the shared behaviour.

Each computes the expected answer in the checker's process, where a submission
cannot patch it or read it from a frame, never from a stored answer:
``offset_sharder``, ``rank_share`` and ``epoch_orders`` with torch's own
``DistributedSampler`` (every rank's sampler, ``num_replicas`` and ``rank``
given), ``line_shards`` from the rule it teaches. The ranks send back only what
the student's code gave.

    ddplab.check.offset_sharder(my_shard)   # = DistributedSampler(shuffle=False, drop_last=True)
    ddplab.check.epoch_orders()             # `orders`: epochs 5, 6, 7 of a resumed run, as uninterrupted
    ddplab.check.rank_share(rank_share)     # per-rank count, padding and dropped samples
    ddplab.check.line_shards()              # the class `LineShards`: a text file by rank and worker

The tables show expected values where they are a function's results for the
check's own inputs; ``epoch_orders`` checks a variable the student's code
fills, so its table says which orders were expected, never the orders.
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import MISSING, checker, compare, passed, require_function, run_student_code, values_on_ranks

#: Seconds a sampler exercise may take on the ranks (a DataLoader with worker processes included).
TIMEOUT = 120.0
#: Nothing here communicates: a hang is the student's own loop that never ends.
_LOOP = "nothing in this exercise waits for another rank: look for a loop that never ends."

__all__ = ["epoch_orders", "line_shards", "offset_sharder", "rank_share"]

#: Dataset sizes the checks try: even, uneven both ways, and smaller than the world.
SIZES = (12, 10, 11, 7, 1)
#: The set_epoch exercise: its dataset size, epochs and seed (the exercise cell uses these).
#: The run resumes at ORDERS_START: it must see what epochs 5, 6, 7 of an uninterrupted run saw.
ORDERS_N, ORDERS_EPOCHS, ORDERS_SEED, ORDERS_START = 12, 3, 0, 5


def _shards(n: int, world: int, **kwargs) -> list[list[int]]:
    """In the checker: every rank's indices of DistributedSampler over ``n`` samples, by rank.

    Made here with the checker's torch (``num_replicas`` and ``rank`` given, no
    process group needed), not on the ranks, where the submission's code runs.
    """
    from torch.utils.data import DistributedSampler
    return [list(DistributedSampler(range(n), num_replicas=world, rank=r, **kwargs))
            for r in range(world)]


# ---------------------------------------------------------------- offset_sharder
def _offset_answers(fn: Callable) -> list:
    """On a rank: the student's indices for each size; the checker knows what they should be."""
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return [[int(i) for i in fn(n, rank, world_size)] for n in SIZES]


@checker
def offset_sharder(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(n, rank, world_size)`` against DistributedSampler(shuffle=False, drop_last=True)."""
    got = run_student_code("my_shard(n, rank, world_size)", _offset_answers, fn, lab=lab,
                           timeout=TIMEOUT, hint=_LOOP)
    world = len(got)
    shards = {n: _shards(n, world, shuffle=False, drop_last=True) for n in SIZES}
    compare(f"my_shard(n, rank, world_size) for n in {list(SIZES)}",
            [[shards[n][rank] for n in SIZES] for rank in range(world)], got,
            hint="start at offset `rank`, step by `world_size`, and stop before the last "
                 "n % world_size samples, which drop_last=True drops.")
    passed("your sharder gives every rank exactly DistributedSampler's indices "
           "(shuffle=False, drop_last=True).")


# ------------------------------------------------------------------ epoch_orders
def _reference_orders(world: int, start: int = ORDERS_START) -> list[list[list[int]]]:
    """In the checker: each rank's orders of epochs ``start``.. of the exercise's sampler."""
    from torch.utils.data import DistributedSampler

    by_rank = []
    for rank in range(world):
        sampler = DistributedSampler(range(ORDERS_N), num_replicas=world, rank=rank, shuffle=True,
                                     seed=ORDERS_SEED)
        orders = []
        for epoch in range(start, start + ORDERS_EPOCHS):
            sampler.set_epoch(epoch)
            orders.append([int(i) for i in sampler])
        by_rank.append(orders)
    return by_rank


@checker
def epoch_orders(lab: Any = None) -> None:
    """Check the ranks' ``orders``: epochs 5, 6 and 7 of a run resumed at epoch 5.

    Each must be the order an uninterrupted run gave in that epoch: set_epoch
    with the true epoch number, not the count since the restart.
    """
    got = values_on_ranks("orders", lab)
    expected = _reference_orders(len(got))
    from_zero = _reference_orders(len(got), 0)
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
        hint = ("an uninterrupted run's sampler: the exercise's dataset, shuffle and seed, and "
                "set_epoch given each epoch's own number before that epoch.")
    compare(f"orders (the indices of epochs {ORDERS_START}..{last})", expected, got, hint=hint,
            show_expected=f"the orders of epochs {ORDERS_START}..{last} of an uninterrupted run")
    passed(f"epochs {ORDERS_START}..{last} of the resumed run see exactly the orders of an "
           f"uninterrupted run.")


# -------------------------------------------------------------------- rank_share
def _share_answers(fn: Callable) -> list:
    """On a rank: the student's ``(per_rank, padded, dropped)`` for each case."""
    import torch.distributed as dist
    world_size = dist.get_world_size()
    got = []
    for n in SIZES:
        for drop_last in (False, True):
            answer = fn(n, world_size, drop_last)
            got.append(tuple(answer) if isinstance(answer, (list, tuple)) else answer)
    return got


def _share(n: int, world: int, drop_last: bool) -> list[tuple[int, int, int]]:
    """Each rank's (its count, samples repeated as padding, samples dropped), from the sampler."""
    shards = _shards(n, world, shuffle=True, drop_last=drop_last)
    seen = [i for shard in shards for i in shard]
    return [(len(mine), len(seen) - len(set(seen)), n - len(set(seen))) for mine in shards]


@checker
def rank_share(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(n, world_size, drop_last)`` -> ``(per_rank, padded, dropped)`` on every rank."""
    got = run_student_code("rank_share(n, world_size, drop_last)", _share_answers, fn, lab=lab,
                           timeout=TIMEOUT, hint=_LOOP)
    world = len(got)
    expected = [_share(n, world, d) for n in SIZES for d in (False, True)]
    cases = [f"(n={n}, drop_last={d})" for n in SIZES for d in (False, True)]
    compare(f"rank_share for {', '.join(cases)}", [[e[rank] for e in expected] for rank in range(world)],
            got,
            hint="drop_last=False pads every rank up to ceil(n / world_size) with repeated "
                 "samples; drop_last=True cuts every rank down to n // world_size.")
    passed("every rank's share, the padding and the dropped samples match DistributedSampler.")


# ------------------------------------------------------------------ line_shards
#: The text file line_shards reads: LINES lines, "line 0" .. "line 22" (23: prime, uneven everywhere).
LINES = 23
#: The DataLoader worker counts it runs; 0 is no workers (get_worker_info() returns None there).
WORKERS = (0, 2, 3)


def _line_number(line: str) -> tuple[int, str]:
    """Sort key: "line 7" before "line 10"; anything else after, as text."""
    tail = line.rsplit(" ", 1)[-1]
    return (int(tail), "") if tail.isdigit() else (LINES, line)


def _line_shard_answers(name: str) -> Any:
    """On a rank: the lines a real DataLoader yields from the student's dataset, per worker count.

    Real worker processes, forked from the rank as a training script's would be
    (fork: the class lives in the rank's namespace, which spawn could not pickle);
    each runs ``__iter__`` on its own copy of the dataset and asks
    ``get_worker_info()`` who it is. Lines are compared sorted by number, so
    what counts is which lines, and how often, not how the workers interleave.
    """
    import os
    import tempfile
    import warnings

    from torch.utils.data import DataLoader

    from ddplab.rank.engine import namespace

    cls = namespace().get(name)
    if not callable(cls):
        return MISSING
    got = []
    with tempfile.TemporaryDirectory(prefix="ddplab-lines-") as folder:
        path = os.path.join(folder, "lines.txt")
        with open(path, "w") as f:
            f.write("".join(f"line {i}\n" for i in range(LINES)))
        for workers in WORKERS:
            with warnings.catch_warnings():
                # "will create 3 worker processes ... suggested max is 2": true on a
                # 2-core machine, absent on a bigger one; these workers read 8 lines.
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                loader = DataLoader(cls(path), batch_size=None, num_workers=workers,
                                    multiprocessing_context="fork" if workers else None)
                got.append(sorted((str(line).rstrip("\n") for line in loader), key=_line_number))
    return got


def _expected_lines(rank: int, world_size: int) -> list[list[str]]:
    """In the checker: rank ``rank``'s lines, sorted, per worker count in ``WORKERS``."""
    # worker w of k keeps line i when i % (world_size * k) == rank * k + w
    return [[f"line {i}" for i in range(LINES) if i % (world_size * (k or 1)) // (k or 1) == rank]
            for k in WORKERS]


@checker
def line_shards(lab: Any = None) -> None:
    """Check ``LineShards(path)``: this rank's and this DataLoader worker's lines of a text file.

    Line i belongs to rank r's worker w of k when ``i % (world_size * k) == r * k + w``;
    with no workers (``get_worker_info()`` is None) k is 1 and w is 0. The checker
    reads a 23-line file through a real DataLoader with 0, 2 and 3 worker
    processes on every rank: together a rank's workers must yield exactly the
    lines of its k workers, each once.
    """
    got = run_student_code("DataLoader(LineShards(path))", _line_shard_answers, "LineShards",
                           lab=lab, timeout=TIMEOUT, hint=_LOOP)
    require_function(got, "LineShards", kind="class")
    compare(f"the lines DataLoader(LineShards(path), num_workers=k) yields on each rank, "
            f"sorted, for k in {list(WORKERS)}",
            [_expected_lines(rank, len(got)) for rank in range(len(got))], got,
            hint="in __iter__, ask torch.utils.data.get_worker_info() who this worker is (None "
                 "means one worker, id 0 of 1); split the lines between the ranks and then between "
                 "a rank's workers, so each line goes to exactly one (rank, worker); strip the "
                 "newline.")
    passed("every rank and every DataLoader worker reads its own lines, and together they read "
           "each line once.")
