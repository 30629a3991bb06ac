"""A deadlocked %%ranks cell says the likely cause (issue 30): all in recv, all in send, DDP on one
rank, new_group some ranks skipped; an exercise cell says it within its 15 s."""

from __future__ import annotations

import pathlib
import time

import nbformat
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
    # DDP once on every rank first: a fresh rank's first DDP imports torch modules
    # for seconds under load, and the hint needs rank 0 inside DDP by the timeout.
    fresh_lab.run_cell("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                       "DDP(torch.nn.Linear(3, 2))\n", timeout=120)
    message = _hang(fresh_lab, "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                               "model = torch.nn.Linear(3, 2)\n"
                               "if rank == 0:\n"
                               "    ddp_model = DDP(model)\n")
    assert "rank 1: finished" in message, message
    assert "Hint: rank 0 is inside DDP(model). DDP(model) is itself a collective" in message
    assert "a %%ranks cell, not %%rank 0 and not under `if rank == 0:`" in message


def test_a_send_and_its_recv_with_different_tags(fresh_lab):
    message = _hang(fresh_lab, "t = torch.zeros(1)\n"
                               "if rank == 0:\n"
                               "    dist.send(t, dst=1, tag=1)\n"
                               "else:\n"
                               "    dist.recv(t, src=0, tag=2)\n")
    assert ("Hint: rank 0 sends to rank 1 with tag=1, and rank 1 waits in recv from rank 0 "
            "with tag=2") in message, message
    assert "the same tag" in message


def test_a_broadcast_whose_source_is_each_ranks_own(fresh_lab):
    message = _hang(fresh_lab, "t = torch.zeros(1)\n"
                               "dist.broadcast(t, src=dist.get_rank())\n")
    assert ("Hint: the ranks name different sources in broadcast: src=0 on rank 0, src=1 on "
            "rank 1") in message, message
    assert "src=rank, or src=dist.get_rank(), makes each rank its own source" in message


NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def _magic_line(notebook: str, cell_id: str) -> str:
    """The first line of an exercise cell as the notebook has it: its ``%%ranks`` options."""
    cells = nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
    return next(cell for cell in cells if cell.get("id") == cell_id).source.splitlines()[0]


@pytest.mark.parametrize("notebook, cell_id, answer, hint, which_lab", [
    ("01_point_to_point.ipynb", "exercise-ring-token",
     "token = torch.zeros(1)\n"
     "dist.recv(token, src=(rank - 1) % world_size)\n"
     "dist.send(token + rank, dst=(rank + 1) % world_size)\n",
     "Hint: every rank is waiting in recv, and no rank is sending", "fresh_lab"),
    ("00_setup.ipynb", "exercise-mean-score",
     "totals = torch.tensor([1.0, 2.0])\n"
     "if rank == 0:\n"
     "    dist.all_reduce(totals)\n",
     "ddplab: rank 0 waits in collective #1 (all_reduce) on the default group, which rank 1 never "
     "reached", "fresh_lab"),
    ("02b_collectives_gather_scatter.ipynb", "exercise-parity-sum",     # "once": read as one rank
     "if rank == 0:\n"
     "    even_ranks = dist.new_group(list(range(0, world_size, 2)))\n"
     "    odd_ranks = dist.new_group(list(range(1, world_size, 2)))\n",
     "Hint: rank 0 waits in new_group for ranks 1, 2, 3, which finished the cell without calling "
     "it. new_group is itself a collective of all ranks", "fresh_lab4"),
])
def test_an_exercise_cell_that_deadlocks_says_why_within_its_timeout(shell, request, notebook, cell_id,
                                                               answer, hint, which_lab):
    """A wrong answer in the exercise cell, under the cell's own magic line, run by the magic."""
    lab = request.getfixturevalue(which_lab)
    line = _magic_line(notebook, cell_id)
    assert line == "%%ranks --timeout 15", line
    # The same magic with the shortest timeout that still shows the hang: 15 s ends it the same way.
    start = time.monotonic()
    error = shell.run_cell(f"{line.replace('15', '5')}\n{answer}").error_in_exec
    took = time.monotonic() - start
    lab.restart()
    assert isinstance(error, ddplab.HangError), error
    message = str(error)
    # Ranks that finished while another waits are a hang at once (``stall.Watch.abandoned``).
    assert ("did not finish within timeout=5 s" in message
            or "said now rather than at timeout=5 s" in message), message
    assert hint in message, message
    assert took < 4 * 5                     # the cell's timeout, not the lab's 60 s


@pytest.mark.parametrize("states, where, expected", [
    ({0: "still running", 1: "still running"}, {0: "in recv (cell line 2)", 1: "in recv (cell line 2)"},
     "every rank is waiting in recv"),
    ({0: "still running", 1: "still running"}, {0: "in send (cell line 2)", 1: "in send (cell line 2)"},
     "every rank is waiting in send"),
    ({0: "still running", 1: "finished"}, {0: "in recv (cell line 4)"},
     "ranks wait in send/recv for rank 1, which finished the cell"),
    ({0: "still running", 1: "still running"}, {0: "in recv (cell line 2)", 1: "at cell line 3"}, ""),
    ({0: "still running", 1: "finished", 2: "still running", 3: "finished"},
     {0: "in new_group (cell line 2)", 2: "in new_group (cell line 2)"},
     "ranks 0, 2 wait in new_group for ranks 1, 3, which finished the cell without calling it. "
     "new_group is itself a collective of all ranks"),
    # A collective skipped or mismatched: the flight recorder's verdict says it, not a hint.
    ({0: "still running", 1: "finished"}, {0: "in all_reduce (cell line 3)"}, ""),
])
def test_the_hint_follows_where_the_ranks_wait(states, where, expected):
    hint = diagnose.deadlock_hint(states, where, {})
    assert (expected in hint) if expected else hint == "", hint


def test_isend_and_irecv_with_different_tags_then_wait_is_a_wait_not_own_code(fresh_lab):
    message = _hang(fresh_lab, "t = torch.zeros(1)\n"
                               "if rank == 0:\n"
                               "    w = dist.isend(t, dst=1, tag=1)\n"
                               "else:\n"
                               "    w = dist.irecv(t, src=0, tag=2)\n"
                               "w.wait()\n")
    assert message.startswith(f"ddplab: the cell did not finish within timeout={TIMEOUT:g} s; ranks "
                              f"are probably waiting for each other (a deadlock)."), message
    assert "  rank 0: still in Work.wait (cell line 6)\n  rank 1: still in Work.wait (cell line 6)" \
        in message
    assert ("Hint: every rank still running waits in .wait() on the handle an isend or irecv (or a "
            "call with async_op=True) returned") in message and "has another tag" in message
    assert "running their own code" not in message


def test_a_tag_mismatch_beside_ranks_that_finished_blames_the_pair(fresh_lab4):
    # Ranks 2 and 3 finish: the hint is the tags of ranks 0 and 1, not "waiting for ranks 2, 3".
    message = _hang(fresh_lab4, "t = torch.zeros(1)\n"
                                "if rank == 0:\n"
                                "    dist.send(t, dst=1, tag=1)\n"
                                "elif rank == 1:\n"
                                "    dist.recv(t, src=0, tag=2)\n")
    assert ("Hint: rank 0 sends to rank 1 with tag=1, and rank 1 waits in recv from rank 0 with "
            "tag=2") in message, message
    assert "which finished the cell" not in message
