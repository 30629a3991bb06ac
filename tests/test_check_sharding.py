"""The notebook 04 checkers against one right and several wrong answers, on real engines."""

from __future__ import annotations

import math
import os

import pytest

import ddplab

pytestmark = pytest.mark.slow


def right_shard(n, rank, world_size):
    return list(range(rank, n - n % world_size, world_size))


def blocks_shard(n, rank, world_size):            # contiguous blocks, not interleaved
    size = n // world_size
    return list(range(rank * size, (rank + 1) * size))


def no_drop_shard(n, rank, world_size):           # i % world_size == rank: keeps the tail
    return [i for i in range(n) if i % world_size == rank]


@pytest.mark.parametrize("fixture", ["fresh_lab", "fresh_lab4"])
def test_offset_sharder_accepts_the_sampler_indices(fixture, request, capsys):
    request.getfixturevalue(fixture)
    ddplab.check.offset_sharder(right_shard)
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct: your sharder gives every")


@pytest.mark.parametrize("wrong,ranks", [(blocks_shard, "ranks 0, 1"), (no_drop_shard, "rank 0")])
def test_offset_sharder_rejects(fresh_lab, wrong, ranks):
    with pytest.raises(AssertionError, match=rf"(?s)is wrong on {ranks}\..*Hint: start at offset"):
        ddplab.check.offset_sharder(wrong)


RIGHT_LOOP = """
from torch.utils.data import DistributedSampler

sampler = DistributedSampler(list(range(12)), shuffle=True, seed=0)
start_epoch = 5
orders = []
for epoch in range(start_epoch, start_epoch + 3):
    sampler.set_epoch(epoch)
    orders.append(list(sampler))
"""


def test_epoch_orders_accepts_set_epoch(fresh_lab, capsys):
    fresh_lab.run_cell(RIGHT_LOOP)
    ddplab.check.epoch_orders()
    assert capsys.readouterr().out.splitlines()[-1] == \
        "Correct: epochs 5..7 of the resumed run see exactly the orders of an uninterrupted run."


@pytest.mark.parametrize("edit,hint", [
    (("    sampler.set_epoch(epoch)\n", ""), "every epoch has the same order: call sampler.set_epoch"),
    (("set_epoch(epoch)", "set_epoch(0)"), "every epoch has the same order"),
    (("set_epoch(epoch)", "set_epoch(epoch - start_epoch)"), "these are the orders of epochs 0-2"),
    (("seed=0", "seed=rank"), "an uninterrupted run's sampler"),
    (("shuffle=True", "shuffle=False"), "the indices come in order, unshuffled"),
])
def test_epoch_orders_rejects(fresh_lab, edit, hint):
    fresh_lab.run_cell(RIGHT_LOOP.replace(*edit))
    with pytest.raises(AssertionError,
                       match=rf"(?s)orders \(the indices of epochs 5..7\) is wrong.*Hint: {hint}") as info:
        ddplab.check.epoch_orders()
    # The orders are the answer: the table says which were expected, never what they are.
    assert "expected the orders of epochs 5..7 of an uninterrupted run\n" in str(info.value)
    assert str(info.value).count("expected") == str(info.value).count("expected the orders")


def test_epoch_orders_names_a_missing_variable(fresh_lab):
    fresh_lab.run_cell("orders = None\ndel orders\norders_typo = []")
    with pytest.raises(AssertionError, match="no variable `orders`"):
        ddplab.check.epoch_orders()


def right_share(n, world_size, drop_last):
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    total = per_rank * world_size
    return per_rank, max(0, total - n), max(0, n - total)


def floor_share(n, world_size, drop_last):          # forgets the padding
    per_rank = n // world_size
    return per_rank, 0, n - per_rank * world_size


def swapped_share(n, world_size, drop_last):
    per_rank, padded, dropped = right_share(n, world_size, drop_last)
    return per_rank, dropped, padded


@pytest.mark.parametrize("fixture", ["fresh_lab", "fresh_lab4"])
def test_rank_share_accepts_the_samplers_counts(fixture, request, capsys):
    request.getfixturevalue(fixture)
    ddplab.check.rank_share(right_share)
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct: every rank's share")


@pytest.mark.parametrize("wrong", [floor_share, swapped_share])
def test_rank_share_rejects(fresh_lab, wrong):
    with pytest.raises(AssertionError, match=r"rank_share for .* is wrong on ranks 0, 1"):
        ddplab.check.rank_share(wrong)


LINE_SHARDS = """
from torch.utils.data import IterableDataset, get_worker_info

class LineShards(IterableDataset):
    def __init__(self, path):
        self.path = path

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        with open(self.path) as f:
            for i, line in enumerate(f):
                if i % (world_size * workers) == rank * workers + worker:
                    yield line.rstrip("\\n")
"""


def test_line_shards_accepts_rank_and_worker_splitting(fresh_lab, capsys):
    fresh_lab.run_cell(LINE_SHARDS)
    ddplab.check.line_shards()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "Correct: every rank and every DataLoader worker "
        "reads its own lines, and together they read each line once.")


@pytest.mark.parametrize("edit", [
    ("world_size * workers) == rank * workers + worker", "world_size) == rank"),     # ignores workers
    ("world_size * workers) == rank * workers + worker", "workers) == worker"),      # ignores ranks
    # Asks who it is when the dataset is made, in the rank's own process (None
    # there), not in each worker: only real DataLoader workers catch this one.
    ("        self.path = path\n", "        self.path = path\n        self.info = get_worker_info()\n"),
])
def test_line_shards_rejects_splitting_by_one_level_only(fresh_lab, edit):
    source = LINE_SHARDS.replace(*edit)
    if "self.info" in source:
        source = source.replace("        info = get_worker_info()\n", "        info = self.info\n")
    assert source != LINE_SHARDS
    fresh_lab.run_cell(source)
    with pytest.raises(AssertionError, match=r"(?s)the lines DataLoader\(LineShards\(path\), "
                                             r"num_workers=k\) yields.*is wrong.*Hint: in __iter__"):
        ddplab.check.line_shards()


def test_line_shards_workers_are_real_processes_that_end(fresh_lab):
    """The check runs the dataset in forked DataLoader workers, and none is left behind."""
    fresh_lab.run_cell(LINE_SHARDS.replace(
        "                    yield line.rstrip(\"\\n\")",
        "                    yield line.rstrip(\"\\n\") + (' in a worker' if info and os.getpid() != "
        "parent else '')") + "\nimport os\nparent = os.getpid()\n")
    with pytest.raises(AssertionError, match="line 1 in a worker"):
        ddplab.check.line_shards()
    import psutil
    engines = [psutil.Process(pid) for pid in fresh_lab.run(os.getpid)]
    assert [e.children() for e in engines] == [[] for _ in engines]


def test_line_shards_names_a_missing_class(fresh_lab):
    fresh_lab.run_cell("LineShards = None")
    with pytest.raises(AssertionError, match="no class `LineShards` on ranks 0, 1"):
        ddplab.check.line_shards()


# Issue 46: the expected answer was made on the rank, in the frame that called the student's
# function; read from there, it passed.
def share_from_the_checkers_frame(n, world_size, drop_last):
    import sys

    expected = sys._getframe(1).f_locals.get("expected")
    return expected[-1] if expected else (0, 0, 0)


PATCHED_SAMPLER = """
import torch.utils.data

class Agreeing(torch.utils.data.DistributedSampler):
    # The checker's expected indices came from DistributedSampler on the rank: make it agree.
    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

torch.utils.data.DistributedSampler = Agreeing
"""


def test_answers_read_or_forged_on_the_ranks_do_not_pass(fresh_lab):
    with pytest.raises(AssertionError, match=r"rank_share for .* is wrong on ranks 0, 1"):
        ddplab.check.rank_share(share_from_the_checkers_frame)
    fresh_lab.run_cell(PATCHED_SAMPLER)
    try:
        with pytest.raises(AssertionError, match="is wrong on rank 0"):
            ddplab.check.offset_sharder(no_drop_shard)
    finally:
        fresh_lab.restart()           # the patched sampler stays on the ranks


# Issue 46: line_shards made its expected lines on the rank, in the frame that read the student's
# dataset; DataLoader's workers are forks of the rank, so they could read that frame too.
FRAME_READING_LINES = """
import sys
from torch.utils.data import IterableDataset, get_worker_info

class LineShards(IterableDataset):
    def __init__(self, path):
        self.path = path

    def __iter__(self):
        frame = sys._getframe(1)
        while frame is not None and "expected" not in frame.f_locals:
            frame = frame.f_back
        lines = frame.f_locals["expected"][-1] if frame is not None else []
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter([line for j, line in enumerate(lines) if j % workers == worker])
"""


def test_line_shards_read_from_the_checkers_frame_do_not_pass(fresh_lab):
    fresh_lab.run_cell(FRAME_READING_LINES)
    with pytest.raises(AssertionError, match="is wrong on ranks 0, 1"):
        ddplab.check.line_shards()


def test_epoch_orders_are_not_judged_by_a_sampler_the_ranks_patched(fresh_lab):
    # Unshuffled orders, and a sampler patched on the ranks to agree: the reference is the checker's.
    fresh_lab.run_cell(PATCHED_SAMPLER + "orders = [list(range(rank, 12, world_size))] * 3\n")
    try:
        with pytest.raises(AssertionError, match="unshuffled: the sampler needs shuffle=True"):
            ddplab.check.epoch_orders()
    finally:
        fresh_lab.restart()           # the patched sampler stays on the ranks
