"""Calls that name a rank the lab lacks, or that a rank must not make, fail at once with what to do."""

import pytest

import ddplab
from ddplab.errors import ConfigError, RankError


def test_lab_debug_of_a_rank_the_lab_does_not_have_names_the_ranks(fresh_lab):
    with pytest.raises(ConfigError, match=r"lab.debug\(rank=7\)") as raised:
        fresh_lab.debug(rank=7)
    assert "0..1" in str(raised.value)


def test_a_breakpoint_on_a_rank_that_does_not_exist_fails_the_cell_instead_of_being_skipped(fresh_lab):
    with pytest.raises(RankError) as raised:
        fresh_lab.run_cell("import ddplab\nddplab.breakpoint(rank=5)\n", timeout=20)
    message = str(raised.value)
    assert "ddplab.breakpoint(rank=5): no rank has that number here" in message
    assert "one of 0..1" in message
    assert fresh_lab.healthy                          # nothing stopped: the cell simply failed


def test_a_breakpoint_outside_a_group_checks_only_the_type(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="a rank number"):
        ddplab.breakpoint(rank="0")


def test_a_lab_cannot_be_started_from_a_rank(fresh_lab):
    """A nested lab would be owned by no notebook: its engines and private folder would outlive it."""
    with pytest.raises(RankError) as raised:
        fresh_lab.run_cell("import ddplab\nddplab.start(world_size=2)\n", timeout=20)
    assert "ddplab.start() ran on a rank" in str(raised.value)
    assert fresh_lab.healthy


def test_lab_run_with_arguments_that_cannot_travel_says_what_can(fresh_lab):
    import threading

    def f(x):
        return x

    with pytest.raises(ConfigError, match="given the lab itself"):
        fresh_lab.run(f, fresh_lab)
    with pytest.raises(ConfigError, match="could not send f and its arguments") as raised:
        fresh_lab.run(f, threading.Lock())
    assert "Pass plain data" in str(raised.value) and "lock" in str(raised.value)
    assert fresh_lab.run(f, 3) == [3, 3]                  # and the lab goes on


def test_a_rank_receiving_from_itself_is_told_so(fresh_lab):
    with pytest.raises(RankError) as raised:
        fresh_lab.run_cell("import torch\nimport torch.distributed as dist\n"
                           "dist.recv(torch.zeros(1), src=rank)\n", ranks=[0], timeout=20)
    assert "sent to or received from itself" in str(raised.value)
    assert fresh_lab.healthy


# What torch 2.11 (NCCL 2.28.9) raised on an H200 when two ranks of one group took cuda:0
# (tools/gpu_check.sh's shared_gpu step, issue 60), raised here by hand: this machine has no GPU.
NCCL_SHARED_GPU = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage "
                   "(run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9\\n"
                   "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\\n"
                   "Last error:\\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 60")


def test_two_ranks_on_one_gpu_under_nccl_are_told_to_take_one_each_or_use_gloo(fresh_lab):
    with pytest.raises(RankError) as raised:
        fresh_lab.run_cell("import torch.distributed as dist\n"
                           f"raise dist.DistBackendError('{NCCL_SHARED_GPU}')\n", timeout=20)
    message = str(raised.value)
    assert "Duplicate GPU detected" in message                   # nccl's own words stay
    assert "two ranks of this group are on one GPU, and nccl needs a GPU of its own" in message
    assert "This machine has 0 GPUs for 2 ranks" in message
    assert "device_id=torch.device('cuda', local_rank)" in message and "'gloo'" in message
    assert fresh_lab.healthy
