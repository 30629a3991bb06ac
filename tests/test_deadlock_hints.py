"""A deadlocked %%ranks cell says the likely cause (issue 30): all in recv, all in send, DDP on one rank."""

from __future__ import annotations

import time

import pytest

import ddplab
from ddplab.lab import diagnose

pytestmark = pytest.mark.slow

TIMEOUT = 5


def _hang(lab, source) -> str:
    start = time.monotonic()
    with pytest.raises(ddplab.HangError) as info:
        lab.run_cell(source, timeout=TIMEOUT)
    assert time.monotonic() - start < 4 * TIMEOUT       # the cell's timeout, not the lab's 60 s
    lab.restart()
    return str(info.value)


def test_a_ring_where_every_rank_receives_first(fresh_lab4):
    message = _hang(fresh_lab4, "token = torch.zeros(1)\n"
                                "dist.recv(token, src=(rank - 1) % world_size)\n"
                                "dist.send(token, dst=(rank + 1) % world_size)\n")
    assert "rank 3: still in recv (cell line 2)" in message, message
    assert "Hint: every rank is waiting in recv, and no rank is sending" in message
    assert "rank 0 sends, then receives last" in message


def test_ranks_that_all_send_first(fresh_lab):
    message = _hang(fresh_lab, "big = torch.zeros(1 << 20)\n"
                               "dist.send(big, dst=1 - rank)\n"
                               "dist.recv(big, src=1 - rank)\n")
    assert "Hint: every rank is waiting in send" in message, message
    assert "dist.isend" in message


def test_ddp_made_on_rank_0_only_says_the_constructor_is_a_collective(fresh_lab):
    message = _hang(fresh_lab, "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                               "model = torch.nn.Linear(3, 2)\n"
                               "if rank == 0:\n"
                               "    ddp_model = DDP(model)\n")
    assert "rank 1: finished" in message, message
    assert "Hint: rank 0 is inside DDP(model). DDP(model) is itself a collective" in message
    assert "a %%ranks cell, not %%rank 0 and not under `if rank == 0:`" in message


@pytest.mark.parametrize("states, where, expected", [
    ({0: "still running", 1: "still running"}, {0: "in recv (cell line 2)", 1: "in recv (cell line 2)"},
     "every rank is waiting in recv"),
    ({0: "still running", 1: "still running"}, {0: "in send (cell line 2)", 1: "in send (cell line 2)"},
     "every rank is waiting in send"),
    ({0: "still running", 1: "finished"}, {0: "in recv (cell line 4)"},
     "ranks wait in send/recv for rank 1, which finished the cell"),
    ({0: "still running", 1: "still running"}, {0: "in recv (cell line 2)", 1: "at cell line 3"}, ""),
])
def test_the_hint_follows_where_the_ranks_wait(states, where, expected):
    hint = diagnose.deadlock_hint(states, where, {})
    assert (expected in hint) if expected else hint == "", hint
