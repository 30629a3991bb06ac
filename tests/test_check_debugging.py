"""Checkers of notebook 09 (the bug zoo): each rejects the bug with a message naming it, and
passes the fix.

The student's code runs on the ranks of a real 2-rank gloo lab, as the
notebook's %%ranks exercise cells would. A bug that hangs is given a short
timeout (``debugging.TIMEOUT``), so the test waits seconds, not the notebook's 10.
"""

from __future__ import annotations

import pytest
from conftest import fails, last_line

import ddplab
from ddplab.check import debugging

pytestmark = pytest.mark.slow


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setattr(debugging, "TIMEOUT", 4.0)


def test_checkers_are_public_under_their_own_names():
    for name in debugging.__all__:
        assert getattr(ddplab.check, name) is getattr(debugging, name)
        assert getattr(debugging, name).__doc__


# ------------------------------------------------------------- 1: a skipped collective
MEAN_LOSS = """
def mean_loss(loss):
    loss = loss.clone()
    {reduce}
    return loss {divide}
"""


def test_mean_loss_accepts_the_fix(fresh_lab, capsys):
    fresh_lab.run_cell(MEAN_LOSS.format(reduce="dist.all_reduce(loss)", divide="/ world_size"))
    debugging.mean_loss()
    assert last_line(capsys) == "Correct: every rank called the all_reduce and got the mean loss 1.5."


def test_mean_loss_rejects_a_collective_only_rank_0_calls(fresh_lab, short):
    fresh_lab.run_cell(MEAN_LOSS.format(reduce="if rank == 0: dist.all_reduce(loss)", divide=""))
    fails(debugging.mean_loss, "did not finish within 4 s", "a rank skipped the all_reduce")


def test_mean_loss_rejects_the_sum(fresh_lab):
    fresh_lab.run_cell(MEAN_LOSS.format(reduce="dist.all_reduce(loss)", divide=""))
    fails(debugging.mean_loss, "mean_loss(rank + 1) is wrong", "divide by the number of ranks")


# ------------------------------------------------------------- 2: uneven batches
UNEVEN = """
import torch.nn.functional as F
def train_uneven(model, optimizer, batches):
    {join}
        for x, y in {batches}:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    {after}
"""


def uneven(join="with model.join():", batches="batches", after=""):
    return UNEVEN.format(join=join, batches=batches, after=after)


def test_uneven_batches_accepts_join(fresh_lab, capsys):
    fresh_lab.run_cell(uneven())
    debugging.uneven_batches()
    assert last_line(capsys) == ("Correct: ranks with 3 and 5 batches trained on every batch and "
                                 "finished together, on the weights DDP with join computes.")


def test_uneven_batches_accepts_join_dividing_by_the_ranks_still_training(fresh_lab, capsys):
    # The other divisor join offers: a different result, as right as the default's.
    fresh_lab.run_cell(uneven(join="with model.join(divide_by_initial_world_size=False):"))
    debugging.uneven_batches()
    assert last_line(capsys).startswith("Correct: ranks with 3 and 5 batches trained on every batch")


def test_uneven_batches_rejects_the_loop_without_join(fresh_lab, short):
    fresh_lab.run_cell(uneven(join="if True:"))
    fails(debugging.uneven_batches, "did not finish within 4 s", "with model.join():")


def test_uneven_batches_rejects_a_function_that_does_nothing(fresh_lab):
    # Equal weights come free from DDP's first broadcast: they must not pass a `pass`.
    fresh_lab.run_cell("def train_uneven(model, optimizer, batches):\n    pass\n")
    fails(debugging.uneven_batches, "train_uneven trained on none of its batches",
          "prove nothing", "one SGD step per (x, y) batch")


def test_uneven_batches_rejects_training_only_the_shortest_ranks_count(fresh_lab):
    # No hang and equal weights, but rank 1's last two batches thrown away.
    fresh_lab.run_cell(uneven(join="if True:", batches="batches[:3]"))
    fails(debugging.uneven_batches, "train_uneven skipped batches: it trained rank 1 on 3 of its "
                                    "5 batches", "`with model.join():`")


def test_uneven_batches_rejects_ranks_that_end_apart(fresh_lab):
    fresh_lab.run_cell(uneven(after="with torch.no_grad():\n        model.module.weight += rank"))
    fails(debugging.uneven_batches, "the weights after train_uneven (replayed in one process",
          "is wrong on rank 1.", "model.join()")


def test_uneven_batches_rejects_a_step_on_every_other_batch(fresh_lab):
    # Every batch seen by a forward pass, but the steps are not the ones DDP with join takes.
    fresh_lab.run_cell(uneven(batches="batches[::2] + batches[1::2]"))
    fails(debugging.uneven_batches, "is wrong on ranks 0, 1.", "one optimizer.step() per batch")


# ------------------------------------------------------------- 3: an unused parameter
def test_unused_parameter_accepts_find_unused(fresh_lab, capsys):
    fresh_lab.run_cell("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                       "def wrap(model):\n    return DDP(model, find_unused_parameters=True)\n")
    debugging.no_unused_parameters()
    assert last_line(capsys) == \
        "Correct: 3 DDP steps with an unused head end on the weights of one process."


def test_unused_parameter_rejects_plain_ddp(fresh_lab):
    fresh_lab.run_cell("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                       "def wrap(model):\n    return DDP(model)\n")
    fails(debugging.no_unused_parameters, "fails at its second step", "`aux` never gets one",
          "find_unused_parameters=True")


def test_unused_parameter_rejects_no_ddp(fresh_lab):
    fresh_lab.run_cell("def wrap(model):\n    return model\n")
    fails(debugging.no_unused_parameters, "wrap(model) is a DistributedDataParallel is wrong",
          "got      'Model'")


# ------------------------------------------------------------- 4: a rank-dependent shape
def test_padded_gather_accepts_the_reference(fresh_lab, capsys):
    fresh_lab.run_cell("""
def gather_predictions(preds):
    lengths = [None] * world_size
    dist.all_gather_object(lengths, len(preds))
    padded = torch.zeros(max(lengths))
    padded[:len(preds)] = preds
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, lengths)])
""")
    debugging.padded_gather()
    assert last_line(capsys) == "Correct: 8 predictions of uneven lengths gathered on every rank."


def test_padded_gather_rejects_padding_left_in(fresh_lab):
    fresh_lab.run_cell("""
def gather_predictions(preds):
    padded = torch.zeros(5)
    padded[:len(preds)] = preds
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)
""")
    fails(debugging.padded_gather, "every rank's predictions, in rank order is wrong",
          "cut each rank's padding off")


def test_padded_gather_rejects_only_this_ranks_predictions(fresh_lab):
    fresh_lab.run_cell("def gather_predictions(preds):\n    return preds\n")
    fails(debugging.padded_gather, "is wrong on ranks 0, 1")


# ------------------------------------------------------------- 5: the checkpoint
SAVE_LOAD = """
from ddplab.train import SmallCNN
def save_checkpoint(ddp_model, path):
    {save}
    dist.barrier()
def load_checkpoint(path):
    model = SmallCNN()
    model.load_state_dict(torch.load(path))
    return model
"""


def test_checkpoint_accepts_rank_0_saving_the_module(fresh_lab, capsys):
    fresh_lab.run_cell(SAVE_LOAD.format(
        save="if rank == 0: torch.save(ddp_model.module.state_dict(), path)"))
    debugging.checkpoint_once()
    assert last_line(capsys).startswith("Correct: one checkpoint, written by rank 0")


def test_checkpoint_rejects_every_rank_writing(fresh_lab):
    fresh_lab.run_cell(SAVE_LOAD.format(save="torch.save(ddp_model.module.state_dict(), path)"))
    fails(debugging.checkpoint_once, "torch.save calls per rank is wrong on rank 1",
          "write them once, on rank 0")


def test_checkpoint_rejects_the_module_prefix(fresh_lab):
    fresh_lab.run_cell(SAVE_LOAD.format(save="if rank == 0: torch.save(ddp_model.state_dict(), path)"))
    fails(debugging.checkpoint_once, "start with 'module.'", "ddp_model.module.state_dict()")


# ------------------------------------------------------------- 6: the wrong world size
AVERAGE = "def average(t):\n    t = t.clone()\n    dist.all_reduce(t)\n    return t{divide}\n"


@pytest.mark.parametrize("divide", [" / dist.get_world_size()", " / world_size"])
def test_world_size_mean_accepts_the_groups_size(fresh_lab, capsys, divide):
    fresh_lab.run_cell(AVERAGE.format(divide=divide))
    debugging.world_size_mean()
    assert last_line(capsys) == "Correct: average(t) is the mean over the 2 ranks, and over 1 rank alone."


def test_world_size_mean_rejects_the_lab_size_hard_coded(fresh_lab, capsys):
    # The section's own bug: right on this lab of 2 by luck, so checked in a world of 1 as well.
    fresh_lab.run_cell(AVERAGE.format(divide=" / 2"))
    fails(debugging.world_size_mean, "average(t) divides the sum by 2 in a world of 1 rank, where "
                                     "the mean divides by 1", "dist.get_world_size()")
    # Afterwards the lab's group is the ranks' again, and so are their variables.
    capsys.readouterr()
    fresh_lab.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\n"
                       "print(dist.get_world_size(), world_size, rank, t.item())")
    assert capsys.readouterr().out == "[rank 0]\n2 2 0 2.0\n[rank 1]\n2 2 1 2.0\n"


def test_world_size_mean_rejects_a_hard_coded_4(fresh_lab):
    fresh_lab.run_cell(AVERAGE.format(divide=" / 4"))
    fails(debugging.world_size_mean, "average(t) divides the sum by 4 on the lab's 2 ranks, where "
                                     "the mean divides by 2", "a number written in the code")


def test_world_size_mean_rejects_the_sum(fresh_lab):
    fresh_lab.run_cell(AVERAGE.format(divide=""))
    fails(debugging.world_size_mean, "average(t) returned the sum, not the mean, on the lab's 2 ranks")


def test_world_size_mean_on_4_ranks_rejects_a_hard_coded_4(fresh_lab4, capsys):
    fresh_lab4.run_cell(AVERAGE.format(divide=" / 4"))
    fails(debugging.world_size_mean, "divides the sum by 4 in a world of 1 rank")
    fresh_lab4.run_cell(AVERAGE.format(divide=" / dist.get_world_size()"))
    debugging.world_size_mean()
    assert last_line(capsys) == "Correct: average(t) is the mean over the 4 ranks, and over 1 rank alone."


# ------------------------------------------------------------- 7: set_epoch
ORDERS = """
from torch.utils.data import DistributedSampler
def epoch_orders(data, epochs):
    sampler = DistributedSampler(data, shuffle={shuffle}, seed=0)
    orders = []
    for epoch in range(epochs):
        {set_epoch}
        orders.append(list(sampler))
    return orders
"""


def test_set_epoch_accepts_the_fix(fresh_lab, capsys):
    fresh_lab.run_cell(ORDERS.format(shuffle=True, set_epoch="sampler.set_epoch(epoch)"))
    debugging.shuffled_each_epoch()
    assert last_line(capsys).startswith("Correct: each epoch has its own order")


def test_set_epoch_rejects_the_missing_call(fresh_lab):
    fresh_lab.run_cell(ORDERS.format(shuffle=True, set_epoch="pass"))
    fails(debugging.shuffled_each_epoch, "epoch 1 repeats epoch 0's order on ranks 0, 1",
          "sampler.set_epoch(epoch)")


def test_set_epoch_rejects_an_unshuffled_sampler(fresh_lab):
    fresh_lab.run_cell(ORDERS.format(shuffle=False, set_epoch="sampler.set_epoch(epoch)"))
    fails(debugging.shuffled_each_epoch, "epoch 1 repeats epoch 0's order")


def test_a_missing_function_names_the_exercise_cell(fresh_lab):
    fresh_lab.run_cell("average = None\ndel average")
    fails(debugging.world_size_mean, "raised NameError", "no function `average`")
