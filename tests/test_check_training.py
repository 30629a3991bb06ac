"""Checkers of notebook 05 (DDP training): each accepts right answers and rejects wrong ones.

The student's code runs on the ranks of a real 2-rank gloo lab, as the
notebook's %%ranks exercise cells would, and the checker is called the way a
check cell calls it.
"""

from __future__ import annotations

import pytest
from conftest import fails, last_line

from ddplab.check.nb05_ddp_training import training

pytestmark = pytest.mark.slow

MODEL = """
from torch.nn.parallel import DistributedDataParallel as DDP
from ddplab.train import SmallCNN

torch.manual_seed(rank)
model = SmallCNN()
"""


# ----------------------------------------------------------------- wrap_model
def test_wrap_model_accepts_ddp(fresh_lab, capsys):
    fresh_lab.run_cell(MODEL + "ddp_model = DDP(model)\n")
    training.wrap_model()
    assert last_line(capsys) == \
        "Correct: ddp_model wraps model in DDP, and every rank holds rank 0's weights."


def test_wrap_model_rejects_the_bare_model(fresh_lab):
    fresh_lab.run_cell(MODEL + "ddp_model = model\n")
    fails(training.wrap_model, "type(ddp_model).__name__ is wrong on ranks 0, 1",
          "got      'SmallCNN'", "Hint: wrap the model in torch's DistributedDataParallel")


def test_wrap_model_rejects_data_parallel(fresh_lab):
    fresh_lab.run_cell(MODEL + "ddp_model = torch.nn.DataParallel(model)\n")
    fails(training.wrap_model, "got      'DataParallel'")


def test_wrap_model_rejects_another_model(fresh_lab):
    fresh_lab.run_cell(MODEL + "ddp_model = DDP(SmallCNN())\n")
    fails(training.wrap_model, "ddp_model.module is model: not so on ranks 0, 1.")


def test_wrap_model_rejects_weights_changed_on_one_rank(fresh_lab):
    fresh_lab.run_cell(MODEL + "ddp_model = DDP(model)\n"
                       "if rank == 1:\n    torch.nn.init.zeros_(model.conv1.weight)\n")
    message = fails(training.wrap_model, "the first weights of ddp_model is wrong on rank 1")
    assert "rank 0: expected" in message and "<-- wrong" in message


def test_wrap_model_needs_the_variable(fresh_lab):
    fresh_lab.run_cell("ddp_model = None\ndel ddp_model\n")
    fails(training.wrap_model, "no variable `ddp_model` on ranks 0, 1")


def test_wrap_model_on_rank_0_only_says_ddp_is_a_collective(fresh_lab, monkeypatch):
    import time

    monkeypatch.setattr(training, "_WRAP_TIMEOUT", 5.0)     # 15 s ends the hang the same way
    fresh_lab.run_cell(MODEL + "ddp_model = None\ndel ddp_model\n")
    # %%rank 0: the cell returns after its grace, rank 0 stays inside DDP's constructor.
    fresh_lab.run_cell("ddp_model = DDP(model)\n", ranks=[0], grace=1)
    start = time.monotonic()
    message = fails(training.wrap_model, "did not finish: the ranks are waiting for each other",
                    "Hint: rank 0 is inside DDP(model). DDP(model) is itself a collective",
                    "broadcasts rank 0's weights", "a %%ranks cell, not %%rank 0", "lab.restart()")
    assert time.monotonic() - start < 35                    # 5 s and the report, not the lab's 30 s+
    assert "rank 0: still in" in message, message
    fresh_lab.restart()


def test_wrap_model_on_some_ranks_names_them(fresh_lab):
    fresh_lab.run_cell(MODEL + "ddp_model = None\ndel ddp_model\n")
    fresh_lab.run_cell("ddp_model = 'made on rank 0 only'\n", ranks=[0])
    fails(training.wrap_model, "ddp_model exists on rank 0 but not on rank 1: DDP was constructed "
          "on some ranks only.\nHint: DDP(model) is itself a collective")


# --------------------------------------------------------------- epoch_loader
RIGHT_LOADER = """
from torch.utils.data import DataLoader, DistributedSampler
def epoch_loader(dataset, batch_size, epoch):
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
"""


def test_epoch_loader_accepts_a_sampler_with_set_epoch(fresh_lab, capsys):
    fresh_lab.run_cell(RIGHT_LOADER)
    training.epoch_loader()
    assert last_line(capsys) == ("Correct: each rank gets its own shard, the shards cover the data, "
                                 "and the order changes every epoch.")


def test_epoch_loader_rejects_the_missing_sampler(fresh_lab):
    fresh_lab.run_cell("from torch.utils.data import DataLoader\n"
                       "def epoch_loader(dataset, batch_size, epoch):\n"
                       "    return DataLoader(dataset, batch_size=batch_size, shuffle=True)\n")
    fails(training.epoch_loader, "samples per rank in epoch 0 is wrong on ranks 0, 1",
          "expected 12", "got      24", "DistributedSampler")


def test_epoch_loader_rejects_a_forgotten_set_epoch(fresh_lab):
    fresh_lab.run_cell(RIGHT_LOADER.replace("    sampler.set_epoch(epoch)\n", ""))
    fails(training.epoch_loader, "the order changes from epoch 0 to epoch 1: not so on ranks", "set_epoch")


def test_epoch_loader_rejects_seeds_that_differ_per_rank(fresh_lab):
    fresh_lab.run_cell(RIGHT_LOADER.replace("seed=0", "seed=rank"))
    fails(training.epoch_loader, "the ranks' shards are not disjoint", "same sampler seed",
          "  rank 0: got [", "  rank 1: got [")


def test_epoch_loader_rejects_a_lost_batch_size(fresh_lab):
    fresh_lab.run_cell(RIGHT_LOADER.replace("batch_size=batch_size", "batch_size=1"))
    fails(training.epoch_loader, "largest batch is wrong")


def test_epoch_loader_needs_the_function(fresh_lab):
    fresh_lab.run_cell("epoch_loader = 3\n")
    fails(training.epoch_loader, "no function `epoch_loader` on ranks 0, 1")


# ------------------------------------------------------------ global_accuracy
def test_global_accuracy_accepts_summed_counts(fresh_lab, capsys):
    fresh_lab.run_cell("def global_accuracy(correct, total):\n"
                       "    t = torch.tensor([correct, total], dtype=torch.float64)\n"
                       "    dist.all_reduce(t)\n"
                       "    return (t[0] / t[1]).item()\n")
    training.global_accuracy()
    assert last_line(capsys) == \
        "Correct: global_accuracy(correct, total) sums hits and samples over all ranks."


def test_global_accuracy_rejects_the_local_accuracy(fresh_lab):
    fresh_lab.run_cell("def global_accuracy(correct, total):\n    return correct / total\n")
    fails(training.global_accuracy, "is wrong on ranks 0, 1", "summed across the ranks before the division")


def test_global_accuracy_rejects_the_mean_of_accuracies(fresh_lab):
    fresh_lab.run_cell("def global_accuracy(correct, total):\n"
                       "    a = torch.tensor([correct / total])\n"
                       "    dist.all_reduce(a, op=dist.ReduceOp.AVG)\n"
                       "    return a\n")
    fails(training.global_accuracy, "is wrong on ranks 0, 1", "different numbers of samples")


def test_global_accuracy_rejects_summed_hits_over_local_total(fresh_lab):
    fresh_lab.run_cell("def global_accuracy(correct, total):\n"
                       "    c = torch.tensor([float(correct)])\n"
                       "    dist.all_reduce(c)\n"
                       "    return c / total\n")
    fails(training.global_accuracy, "is wrong on ranks 0, 1")


def test_global_accuracy_reports_a_raise(fresh_lab):
    fresh_lab.run_cell("def global_accuracy(correct, total):\n    raise NotImplementedError()\n")
    message = fails(training.global_accuracy,
                    "NotImplementedError (your %%ranks cell, line 2, in global_accuracy), on ranks 0, 1.",
                    "NotImplementedError()")
    assert message.startswith("NotImplementedError"), message


# ------------------------------------------------------------ save_checkpoint
def test_save_checkpoint_accepts_rank_0_with_a_barrier(fresh_lab, capsys):
    fresh_lab.run_cell("def save_checkpoint(model, path):\n"
                       "    if dist.get_rank() == 0:\n"
                       "        torch.save(model.module.state_dict(), path)\n"
                       "    dist.barrier()\n")
    training.save_checkpoint()
    assert last_line(capsys) == ("Correct: only rank 0 writes the checkpoint, a plain model loads "
                                 "it, and no rank returns early.")


def test_save_checkpoint_rejects_every_rank_saving(fresh_lab):
    fresh_lab.run_cell("def save_checkpoint(model, path):\n"
                       "    torch.save(model.module.state_dict(), path)\n"
                       "    dist.barrier()\n")
    message = fails(training.save_checkpoint, "torch.save calls during save_checkpoint(model, path) "
                    "is wrong on rank 1", "one rank (rank 0) writes the file")
    assert "rank 1: expected 0" in message


def test_save_checkpoint_rejects_the_wrong_rank(fresh_lab):
    fresh_lab.run_cell("def save_checkpoint(model, path):\n"
                       "    if dist.get_rank() == 1:\n"
                       "        torch.save(model.module.state_dict(), path)\n"
                       "    dist.barrier()\n")
    fails(training.save_checkpoint, "is wrong on ranks 0, 1")


def test_save_checkpoint_rejects_the_ddp_state_dict(fresh_lab):
    fresh_lab.run_cell("def save_checkpoint(model, path):\n"
                       "    if dist.get_rank() == 0:\n"
                       "        torch.save(model.state_dict(), path)\n"
                       "    dist.barrier()\n")
    fails(training.save_checkpoint, "a plain SmallCNN loading the file is wrong",
          "RuntimeError", "module.state_dict()")


def test_save_checkpoint_rejects_a_missing_barrier(fresh_lab):
    fresh_lab.run_cell("def save_checkpoint(model, path):\n"
                       "    if dist.get_rank() == 0:\n"
                       "        torch.save(model.module.state_dict(), path)\n")
    message = fails(training.save_checkpoint, "the file exists when save_checkpoint returns: not so "
                    "on rank 1.", "every rank meets the others after the save")
    assert "expected True" not in message


# --------------------------------------------------------------- train_uneven
JOINED = """
from torch.distributed.algorithms import Join

def train_uneven(ddp_model, optimizer, batches):
    steps = 0
    with Join([ddp_model]):
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps
"""


def test_train_uneven_accepts_a_joined_loop(fresh_lab, capsys):
    fresh_lab.run_cell(JOINED)
    training.train_uneven()
    assert last_line(capsys) == ("Correct: ranks with 2, 4 batches each trained on all of theirs, "
                                 "and the 2 ranks ended with the same weights.")


def test_train_uneven_rejects_cutting_every_rank_to_the_fewest_batches(fresh_lab):
    fresh_lab.run_cell("""
def train_uneven(ddp_model, optimizer, batches):
    fewest = torch.tensor(len(batches))
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)      # no deadlock, but rank 1 skips 2 batches
    for x, y in batches[:int(fewest)]:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp_model(x), y).backward()
        optimizer.step()
    return int(fewest)
""")
    fails(training.train_uneven, "steps taken, one per batch of the rank is wrong on rank 1",
          "throws data away")


def test_train_uneven_rejects_a_different_step(fresh_lab):
    fresh_lab.run_cell(JOINED.replace("optimizer.zero_grad()", "pass"))    # gradients pile up
    fails(training.train_uneven, "the weights after the loop is wrong", "zero_grad")


def test_train_uneven_names_the_deadlock_without_join(fresh_lab, monkeypatch):
    # The checker allows 20 s (the right loop takes a few); the loop without Join hangs at
    # once, at its first uneven step, and a shorter timeout ends it the same way.
    monkeypatch.setattr(training, "_UNEVEN_TIMEOUT", 8.0)
    fresh_lab.run_cell(JOINED.replace("with Join([ddp_model]):", "if True:"))
    message = fails(training.train_uneven, "did not finish: the ranks are waiting for each other",
                    "a context manager that lets a rank that is done keep answering",
                    "lab.restart()")
    assert "rank 1" in message, message
    assert not fresh_lab.healthy                         # the checker says so; the next test restarts


def test_train_uneven_names_a_missing_function(fresh_lab):
    fresh_lab.run_cell("train_uneven = None")
    fails(training.train_uneven, "no function `train_uneven` on ranks 0, 1")


def test_global_accuracy_read_from_the_checkers_frame_does_not_pass(fresh_lab):
    """Issue 46: every rank was sent every rank's counts, in the frame that called the student's
    function; the answer read from there, with no all_reduce, passed."""
    fresh_lab.run_cell("def global_accuracy(correct, total):\n    import sys\n"
                       "    seen = sys._getframe(1).f_locals\n"
                       "    if isinstance(seen.get('correct'), list):\n"
                       "        return sum(seen['correct']) / sum(seen['total'])\n"
                       "    return correct / total\n")
    fails(training.global_accuracy, "is wrong on ranks 0, 1")
