"""Checkers of notebooks 00 (mean_score) and 03 (tcp_group): right answers pass, wrong ones fail."""

from __future__ import annotations

import pytest
from conftest import side_lab

import ddplab
from ddplab.check import nb03_init_methods_and_launchers as setup

pytestmark = pytest.mark.slow


RIGHT = """
scores = ddplab_scores(rank)
sums = torch.tensor([scores.sum().item(), float(len(scores))])
dist.all_reduce(sums)
mean_score = sums[:1] / sums[1]
"""


def _prepare(lab):
    lab.run_cell("import torch, torch.distributed as dist\n"
                 "from ddplab.check.nb00_setup import scores_of as ddplab_scores")


def test_mean_score_passes_the_right_answer(fresh_lab, capsys):
    _prepare(fresh_lab)
    fresh_lab.run_cell(RIGHT)
    capsys.readouterr()
    ddplab.check.mean_score()
    assert capsys.readouterr().out == "Correct: every rank holds the mean of all 6 scores of the 2 ranks.\n"
    fresh_lab.run_cell("mean_score = mean_score[0]")      # a 0-d tensor is fine too
    ddplab.check.mean_score()


@pytest.mark.exercise("mean_score", "mistake", "the mean of the ranks' means")
def test_mean_score_rejects_the_mean_of_means_and_names_the_fix(fresh_lab):
    _prepare(fresh_lab)
    fresh_lab.run_cell("mean_score = ddplab_scores(rank).mean().reshape(1)\n"
                       "dist.all_reduce(mean_score)\nmean_score /= world_size")
    with pytest.raises(ddplab.check.Feedback,
                       match=r"(?s)^mean_score holds the mean of the ranks' means, not the mean of all "
                             r"scores, on ranks 0, 1\..*expected the mean of all 6 scores.*"
                             r"got +\[2.0\].*mean of the ranks' means is not the answer") as info:
        ddplab.check.mean_score()
    assert "2.1666" not in str(info.value)          # the answer is never shown


@pytest.mark.exercise("mean_score", "mistake", "each rank's own mean, never reduced")
def test_mean_score_without_all_reduce_is_wrong(fresh_lab):
    _prepare(fresh_lab)
    fresh_lab.run_cell("mean_score = ddplab_scores(rank).mean().reshape(1)")
    with pytest.raises(ddplab.check.Feedback,
                       match=r"(?s)^mean_score holds the rank's own mean only \(nothing was reduced "
                             r"across ranks\) on ranks 0, 1.*got +\[1.5\].*got +\[2.5\]"):
        ddplab.check.mean_score()


@pytest.mark.exercise("mean_score", "stub")
def test_mean_score_missing_names_the_variable(fresh_lab):
    fresh_lab.restart()
    with pytest.raises(AssertionError, match="no variable `mean_score` on ranks 0, 1"):
        ddplab.check.mean_score()


@pytest.fixture(scope="module")
def bare():
    lab = side_lab(2, timeout=20, grace=1.0, init_method=None)
    yield lab
    lab.stop()


TCP = ("import torch.distributed as dist\n"
       "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', "
       "rank=rank, world_size=2)")


@pytest.mark.exercise("tcp_group", "stub")
def test_tcp_group_not_joined_names_the_ranks(bare):
    bare.restart()
    with pytest.raises(ddplab.check.Feedback, match=r"(?s)^ranks 0, 1 have not joined a group.*tcp://"):
        setup.tcp_group(lab=bare)


def test_tcp_group_passes_a_tcp_group(bare, capsys):
    bare.restart()
    bare.run_cell(TCP)
    setup.tcp_group(lab=bare)
    assert capsys.readouterr().out.endswith(
        "Correct: the 2 ranks joined one group over tcp://, each with its own rank.\n")


@pytest.mark.exercise("tcp_group", "mistake", "env:// and torchrun's variables instead of tcp://")
def test_tcp_group_rejects_env(bare):
    bare.restart()
    bare.run_cell("import os, torch.distributed as dist\n"
                  "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), "
                  "RANK=str(rank), WORLD_SIZE='2')\n"
                  "dist.init_process_group('gloo', init_method='env://')")
    with pytest.raises(AssertionError, match=r"(?s)torchrun's variables.*got +\['MASTER_ADDR'.*"
                                             r"tcp:// needs no environment variables"):
        setup.tcp_group(lab=bare)


@pytest.mark.exercise("tcp_group", "mistake", "rank and world_size swapped")
def test_tcp_group_rejects_swapped_ranks(bare):
    bare.restart()
    bare.run_cell(TCP.replace("rank=rank", "rank=1 - rank"))
    with pytest.raises(AssertionError, match=r"(?s)\(rank, world_size\) of the group is wrong on "
                                             r"ranks 0, 1.*%%rank r passes rank=r"):
        setup.tcp_group(lab=bare)
