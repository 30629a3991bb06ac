"""ddplab.check._observe.schedule on a real 2-rank gloo lab: a pipeline schedule seen by the checker.

Notebook 13's stage (``ddplab.pipeline.Stage``) notes its forwards and backwards in
``stage.log``, a list the student's code holds. The checks read it, so a GPipe run
that writes 1F1B's order into the log afterwards was judged 1F1B, "holding at most
2, 1 activations" (issue 54). ``schedule.Watch`` puts the checker's own hooks on the
stage's block and counts the tensors autograd saves: these tests run GPipe, 1F1B and
the lying GPipe on 2 stages of 4 micro-batches, and compare both views.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow      # real labs, like the checkers' own tests


M = 4          # micro-batches


def _gpipe(stage, inputs, targets, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ddplab import pipeline

    sends, outs = [], []
    for i in range(M):
        if rank == 0:
            out = stage(inputs[i])
            sends.append(dist.isend(out.detach(), 1))
        else:
            x = torch.empty_like(inputs[i]).requires_grad_()
            dist.recv(x, 0)
            out = pipeline.loss_fn(stage(x), targets[i]) / M
        outs.append((x if rank else None, out))
    for x, out in outs:
        if rank == 0:
            grad = torch.empty_like(out)
            dist.recv(grad, 1)
            out.backward(grad)
        else:
            out.backward()
            sends.append(dist.isend(x.grad, 0))
    for work in sends:
        work.wait()


def _one_f_one_b(stage, inputs, targets, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ddplab import pipeline

    sends = []
    if rank == 0:                                   # one warm-up forward, then F(i+1), B(i)
        outs = [stage(inputs[0])]
        sends.append(dist.isend(outs[0].detach(), 1))
        for i in range(M):
            if i + 1 < M:
                outs.append(stage(inputs[i + 1]))
                sends.append(dist.isend(outs[-1].detach(), 1))
            grad = torch.empty_like(outs[i])
            dist.recv(grad, 1)
            outs[i].backward(grad)
    else:                                           # the last stage: F(i), B(i)
        for i in range(M):
            x = torch.empty_like(inputs[i]).requires_grad_()
            dist.recv(x, 0)
            (pipeline.loss_fn(stage(x), targets[i]) / M).backward()
            sends.append(dist.isend(x.grad, 0))
    for work in sends:
        work.wait()


def _lying_gpipe(stage, inputs, targets, rank: int) -> None:
    from ddplab import pipeline

    _gpipe(stage, inputs, targets, rank)
    stage.log[:] = pipeline.schedule_order("1F1B", 2, M)[rank]      # 1F1B's order, written after


SCHEDULES = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "lying gpipe": _lying_gpipe}


def _run_schedule(name: str) -> dict:
    """On a rank: one step of schedule ``name`` on its stage, watched; both views."""
    import torch.distributed as dist

    from ddplab import pipeline
    from ddplab.check._observe import schedule, wire

    rank = dist.get_rank()
    stage = pipeline.Stage(pipeline.model(2, seed=3), rank)
    inputs, targets = pipeline.micro_batches(M, seed=4)
    with wire.recording() as record:
        watch = schedule.Watch(record)
        watch.forwards(stage.block, "stage")
        with watch.held():
            SCHEDULES[name](stage, inputs, targets, rank)
        watch.remove()
    return {"watched": watch.order("stage"), "peak": watch.peak, "still_held": len(watch.live),
            "log": list(stage.log), "log_peak": pipeline.live_activations(stage.log),
            "messages": [(op.family, op.peer) for op in record.ops]}


def test_gpipe_and_1f1b_are_watched_in_the_order_they_ran(fresh_lab):
    from ddplab import pipeline

    for name, schedule_name, peaks in (("gpipe", "GPipe", [M, M]), ("1f1b", "1F1B", [2, 1])):
        got = fresh_lab.run(_run_schedule, name, timeout=60)
        for rank, seen in enumerate(got):
            expected = pipeline.schedule_order(schedule_name, 2, M)[rank]
            assert seen["watched"] == expected == seen["log"], (name, rank, seen)
            assert seen["peak"] == peaks[rank] == seen["log_peak"], (name, rank, seen)
            assert seen["still_held"] == 0, (name, rank, seen)      # every activation let go


def test_a_gpipe_that_writes_1f1b_into_its_log_is_seen_as_gpipe(fresh_lab):
    from ddplab import pipeline

    got = fresh_lab.run(_run_schedule, "lying gpipe", timeout=60)
    for rank, seen in enumerate(got):
        # the old way reads the student's list, and says 1F1B, holding 2 and 1
        assert seen["log"] == pipeline.schedule_order("1F1B", 2, M)[rank]
        assert seen["log_peak"] == [2, 1][rank]
        # the checker's hooks saw GPipe: every forward first, all M micro-batches held
        assert seen["watched"] == pipeline.schedule_order("GPipe", 2, M)[rank], seen
        assert seen["peak"] == M, seen
    sends = [family for family, _ in got[0]["messages"] if family == "send"]
    assert len(sends) == M                           # and the wire saw rank 0 send each activation
