"""A hang names the collective each rank is in, and says when the ranks disagree.

The fast tests give ``ddplab.lab.flight.report`` summaries as ranks write them;
the slow ones hang a real lab: a mismatch and a skipped collective.
"""

from __future__ import annotations

import pytest

import ddplab
from ddplab.lab import flight

DEFAULT = "the default group"


def _record(seq, op, sizes, active, group=DEFAULT):
    return {"group": group, "seq": seq, "op": op, "sizes": sizes, "active": active}


def test_a_mismatch_names_the_collective_and_both_ops():
    lines = flight.report({
        0: [_record(2, "all_reduce", [[4]], False), _record(3, "all_gather", [[3]], True)],
        1: [_record(2, "all_reduce", [[4]], False), _record(3, "all_reduce", [[5]], True)]})
    assert lines[1:3] == ["  rank 0: in collective #3 all_gather [3] on the default group",
                          "  rank 1: in collective #3 all_reduce [5] on the default group"]
    assert lines[3].startswith("ddplab: the ranks disagree at collective #3 on the default "
                               "group: all_gather [3] on rank 0, all_reduce [5] on rank 1: a "
                               "mismatch, not a slow rank.")


def test_same_op_different_shapes_is_a_mismatch_too():
    lines = flight.report({0: [_record(1, "all_reduce", [[4]], True)],
                           1: [_record(1, "all_reduce", [[8]], True)]})
    assert "disagree at collective #1" in lines[-1] and "all_reduce [4] on rank 0" in lines[-1]


def test_a_rank_that_issued_fewer_collectives_is_named():
    lines = flight.report({0: [_record(2, "all_reduce", [[2]], True)],
                           1: [_record(1, "all_reduce", [[2]], False)],
                           2: []})
    assert "  rank 1: finished collective #1 all_reduce [2] on the default group" in lines
    assert "  rank 2: no collective yet" in lines
    assert lines[-1] == ("ddplab: rank 0 waits in collective #2 (all_reduce) on the default "
                         "group, which ranks 1, 2 never reached: they issued fewer collectives "
                         "(one skipped behind an `if rank == ...`, or fewer loop steps).")


def test_a_rank_behind_that_is_busy_in_its_own_code_is_not_said_to_have_skipped():
    lines = flight.report({0: [_record(2, "all_reduce", [[2]], True)],
                           1: [_record(1, "all_reduce", [[2]], False)]}, busy=[1])
    assert lines[-1].startswith("ddplab: rank 0 waits in collective #2 (all_reduce) on the default "
                                "group, which rank 1 has not reached yet: it is still running its "
                                "own code. A slow rank reaches it later")
    assert "never reached" not in lines[-1]


def test_other_groups_count_only_their_members():
    lines = flight.report({0: [_record(1, "all_reduce", [[2]], True, "group 1")],
                           1: [_record(1, "all_reduce", [[2]], True, "group 1")],
                           2: [_record(4, "barrier", [[1]], False)]})
    assert not any(line.startswith("ddplab:") for line in lines), lines


def test_no_section_when_nobody_waits_in_a_collective():
    """A send/recv deadlock: the recorder has nothing to say about it."""
    assert flight.report({0: [_record(1, "all_reduce", [[2]], False)],
                          1: [_record(1, "all_reduce", [[2]], False)]}) == []
    assert flight.report({}) == []


def _mismatch():
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        dist.all_gather([torch.zeros(3), torch.zeros(3)], torch.ones(3))
    else:
        dist.all_reduce(torch.ones(5))


def _skipped():
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(2))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(2))


@pytest.mark.slow
def test_a_real_hang_reports_the_recorders_verdict(fresh_lab):
    lab = fresh_lab
    try:
        with pytest.raises(ddplab.HangError) as info:
            lab.run(_mismatch, timeout=3)
        message = str(info.value)
        # The default group's record: a group an earlier test's lab.spawn made may still be
        # in the recorder, and its records come last.
        seq, seq1 = ([r["seq"] for r in info.value.collectives[rank]
                      if r.get("group") == "the default group" and r["active"]][-1] for rank in (0, 1))
        assert seq >= 2 and seq1 == seq
        assert (f"ranks disagree at collective #{seq} on the default group: all_gather [3] on "
                f"rank 0, all_reduce [5] on rank 1: a mismatch, not a slow rank") in message
        lab.restart()
        with pytest.raises(ddplab.HangError) as info:
            lab.run(_skipped, timeout=3)
        message = str(info.value)
        assert "  rank 1: finished" in message
        assert "rank 0 waits in collective #2 (all_reduce) on the default group, which rank 1 " \
               "never reached" in message, message
        lab.restart()
        with pytest.raises(ddplab.HangError) as info:       # a slow rank, not a skipped collective
            lab.run_cell("import time\nimport torch\nif rank == 1:\n    time.sleep(60)\n"
                         "dist.all_reduce(torch.ones(1))\n", timeout=3)
        message = str(info.value)
        assert message.startswith("ddplab: the cell did not finish within timeout=3 s; rank 0 waits "
                                  "for rank 1, which is still running its own code"), message
        assert "rank 1 has not reached yet: it is still running its own code" in message
        assert "never reached" not in message and "deadlock" not in message
        lab.restart()
        with pytest.raises(ddplab.HangError) as info:       # nobody waits for anybody
            lab.run_cell("while True:\n    pass\n", timeout=3)
        assert "no rank is waiting for another: ranks 0, 1 are still running their own code" \
            in str(info.value)
    finally:
        lab.restart()
