"""Checkers whose answer is read off a timeline: right answers pass, wrong ones fail.

Each runs the real thing on a real gloo lab under ``lab.trace()`` and calls the
checker the way a check cell does. The right answer is whatever the run did:
change the run (another rank made slow), and the same answer fails.
"""

from __future__ import annotations

import re

import pytest

import ddplab
from ddplab import trace as tracing

pytestmark = pytest.mark.slow


def fails(checker, answer, *needles: str, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        checker(answer, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def never_tells(message: str, *truths: str) -> None:
    """A failing timeline check names the mistake, never the answer: no right value, no time."""
    for truth in truths:
        assert not re.search(rf"\b{re.escape(truth)}\b", message), message
    assert not re.search(r"\d+(\.\d+)? ?m?s\b", message), message


@pytest.mark.exercise("straggler", "mistake", "a rank that itself waited")
@pytest.mark.exercise("straggler", "mistake", "a rank the trace does not have")
@pytest.mark.exercise("straggler", "bypass")
def test_straggler_follows_the_run_not_a_stored_answer(fresh_lab4, capsys):
    with fresh_lab4.trace():
        fresh_lab4.run(tracing.uneven_work)            # the exercise's run: rank 2 works longest
    ddplab.check.straggler(2)
    assert capsys.readouterr().out == ("Correct: rank 2 arrived last, and every other rank waited "
                                       "for it in the collective.\n")
    message = fails(ddplab.check.straggler, 0, "rank 0 is not the straggler: rank 0 itself waited "
                    "in the collective for another rank (its box is hatched)", "Hint: the straggler")
    never_tells(message, "2")
    message = fails(ddplab.check.straggler, 7, "the trace has ranks 0, 1, 2, 3, and no rank 7")
    with fresh_lab4.trace():                           # now rank 3 is the slow one
        fresh_lab4.run(tracing.uneven_work, {0: 0.05, 1: 0.05, 2: 0.05, 3: 0.6})
    message = fails(ddplab.check.straggler, 2, "rank 2 is not the straggler", "rank 2 itself waited")
    never_tells(message, "3")
    ddplab.check.straggler(3)
    fails(ddplab.check.straggler, "3", "rank number")
    fails(ddplab.check.straggler, True, "rank number")


def test_straggler_needs_a_wait_to_find(fresh_lab4):
    with fresh_lab4.trace():
        fresh_lab4.run_cell("x = 1")
    fails(ddplab.check.straggler, 0, "no rank waited")


@pytest.mark.exercise("who_waited", "mistake", "a send that never waited", cell="check-who-waited")
@pytest.mark.exercise("who_waited", "mistake", "a call the rank never made", cell="check-who-waited")
def test_who_waited_right_and_wrong(fresh_lab):
    with fresh_lab.trace() as tr:
        fresh_lab.run_cell("import time\nt = torch.ones(2)\ndist.barrier()\nif rank == 0:\n"
                           "    time.sleep(0.5)\n    dist.send(t, dst=1)\nelse:\n"
                           "    dist.recv(t, src=0)")
    ddplab.check.who_waited((1, "recv"), tr)
    with fresh_lab.trace() as tr:         # rank 0's barrier waits 0.3 s, then rank 1's recv 1.0 s
        fresh_lab.run_cell("import time\nt = torch.ones(2)\nif rank == 1:\n    time.sleep(0.3)\n"
                           "dist.barrier()\nif rank == 0:\n    time.sleep(1.0)\n    dist.send(t, dst=1)\n"
                           "else:\n    dist.recv(t, src=0)")
    ddplab.check.who_waited((1, "recv"), tr)
    for wrong, why in (((0, "send"), "send on rank 0 did not wait for the other rank at all"),
                       ((1, "send"), "rank 1 made no 'send' call in this trace; it made "),
                       ((5, "recv"), "no rank 5"),
                       ((0, "barrier"), "barrier on rank 0 waited, but another call waited longer")):
        message = fails(ddplab.check.who_waited, wrong, "is not the call that waited longest: ",
                        why, "Hint: waiting is the hatched part", trace=tr)
        # The failure never gives the answer away: neither the right call nor any measured time.
        assert "recv on rank 1" not in message and "rank 1: recv" not in message, message
        never_tells(message)
    fails(ddplab.check.who_waited, "recv", "(rank, op)")


def test_messages_per_rank_counts_the_rings_sends(fresh_lab4, capsys):
    from ddplab.algorithms import ring_all_reduce

    def ring():
        import torch
        return ring_all_reduce(torch.ones(64))

    with fresh_lab4.trace():
        fresh_lab4.run(ring)
    ddplab.check.messages_per_rank(6)                  # 2(p - 1) for p = 4
    assert capsys.readouterr().out == "Correct: each rank sent 6 messages.\n"
    # Issue 64: a count that is off says the count given and which way it is off ("did not send
    # 6: that is too many" said neither), never the traced count or the gap: either is the answer.
    for wrong, way in ((3, "fewer"), (7, "more"), (12, "more"), (24, "more")):
        message = fails(ddplab.check.messages_per_rank, wrong,
                        f"your count, {wrong}, is {way} than the messages each rank sent in the "
                        f"traced run", "Hint: count the arrows leaving one rank's lane")
        for rank in range(4):
            assert f"rank {rank}: got {wrong} (too {'few' if way == 'fewer' else 'many'})" in message
        never_tells(message, "6")           # the traced count; the gap is in no number either
        assert "did not send" not in message and "not a plain ring" not in message
    assert "that counts the receives too" in fails(ddplab.check.messages_per_rank, 12)
    assert "that is every rank's messages together" in fails(ddplab.check.messages_per_rank, 24)


def test_messages_per_rank_of_a_ring_that_sends_extra_says_so_without_the_count(fresh_lab4):
    """Issue 64's case: the ring's cell ran more than a ring (one extra message per rank), and a
    count right for a ring was refused with "did not send 6 ... too many"."""
    from ddplab.algorithms import ring_all_reduce

    def ring_and_one_more():
        import torch
        import torch.distributed as dist
        rank, size = dist.get_rank(), dist.get_world_size()
        out = ring_all_reduce(torch.ones(64))
        extra = dist.isend(torch.ones(1), (rank + 1) % size)
        dist.recv(torch.zeros(1), (rank - 1) % size)
        extra.wait()
        return out

    with fresh_lab4.trace():
        fresh_lab4.run(ring_and_one_more)
    message = fails(ddplab.check.messages_per_rank, 6,
                    "your count, 6, is fewer than the messages each rank sent in the traced run",
                    "the traced run is not a plain ring: each rank sent more messages than a ring's")
    never_tells(message, "7")


def _ddp_backward(steps, cap):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 256),
                                    torch.nn.Linear(256, 8)), bucket_cap_mb=cap)
    for _ in range(steps):
        model(torch.randn(16, 64)).sum().backward()


def test_ddp_all_reduces_counts_the_buckets_of_the_last_backward(fresh_lab, capsys):
    with fresh_lab.trace():
        fresh_lab.run(_ddp_backward, 3, 0.2)
    trace = tracing.last()
    last = [c for c in trace.compute if c.rank == 0][-1]
    count = len([e for e in trace.on(0) if e.source == "torch" and e.op == "all_reduce"
                 and last.start <= e.start <= last.end])
    assert count >= 2
    ddplab.check.ddp_all_reduces(count)
    assert capsys.readouterr().out.startswith(f"Correct: DDP issued {count} bucket all_reduce(s)")
    message = fails(ddplab.check.ddp_all_reduces, count + 1, f"{count + 1} all_reduce(s) is not what "
                    "DDP issued during the last backward: DDP issued fewer during the last backward "
                    "on rank 0", "purple")
    never_tells(message, str(count))
    every = len([e for e in trace.on(0) if e.source == "torch" and e.op == "all_reduce"])
    message = fails(ddplab.check.ddp_all_reduces, every, "counts the all_reduces of every backward")
    never_tells(message, str(count))
    with fresh_lab.trace():                    # one big bucket: the same answer is now wrong
        fresh_lab.run(_ddp_backward, 3, 25)
    message = fails(ddplab.check.ddp_all_reduces, count, "DDP issued fewer")
    never_tells(message, "1")
    with fresh_lab.trace():
        fresh_lab.run_cell("x = 1")
    fails(ddplab.check.ddp_all_reduces, 1, "no backward pass")


def test_every_checker_says_to_trace_first(fresh_lab, monkeypatch):
    monkeypatch.setattr(tracing.record, "_last", None)
    for checker, answer in ((ddplab.check.straggler, 0), (ddplab.check.who_waited, (0, "send")),
                            (ddplab.check.ddp_all_reduces, 1), (ddplab.check.messages_per_rank, 1)):
        fails(checker, answer, "Hint: run that cell first", "lab.trace()")
