"""The notebook-13 checkers: pipeline schedules built from isend/irecv, compared with one process.

For each check: the reference solution passes, the stub fails, the library fails (refused), and
plausible wrong solutions fail with a message naming the mistake; a 1F1B that deadlocks is
reported within the check's timeout, naming each rank and the call it is stuck in.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from conftest import fails

from ddplab import pipeline
from ddplab.check.nb13_build_pipelines import schedules as check

pytestmark = pytest.mark.slow


# ------------------------------------------------------- the reference solutions
def pipeline_forward(stage, micro_batch):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        x = micro_batch
    else:
        x = torch.empty_like(micro_batch)
        dist.recv(x, src=rank - 1)
    y = stage(x)
    if rank < world_size - 1:
        dist.send(y.detach(), dst=rank + 1)
    return y


def _schedule(stage, inputs, targets, order, scale=True, zero_between=False, back_to=-1):
    """GPipe (order "gpipe") or 1F1B ("1f1b"), right by default; the flags make it wrong."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    m = len(inputs)
    first, last = rank == 0, rank == world_size - 1
    held, requests = {}, []

    def forward(i):
        if first:
            x = inputs[i]
        else:
            x = torch.empty_like(inputs[i])
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if not last:
            requests.append(dist.isend(y.detach(), dst=rank + 1))
        held[i] = (x, y)

    def backward(i):
        x, y = held.pop(i)
        if zero_between:
            stage.zero_grad()
        if last:
            loss = pipeline.loss_fn(y, targets[i])
            (loss / m if scale else loss).backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, src=rank + 1)
            y.backward(grad)
        if not first:
            requests.append(dist.isend(x.grad, dst=rank + back_to))

    warmup = m if order == "gpipe" else min(world_size - 1 - rank, m)
    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    for request in requests:
        request.wait()


def gpipe_step(stage, inputs, targets):
    _schedule(stage, inputs, targets, "gpipe")


def one_f_one_b_step(stage, inputs, targets):
    _schedule(stage, inputs, targets, "1f1b")


def bubble_fraction(events):
    ranks = {e.rank for e in events}
    start, end = min(e.start for e in events), max(e.end for e in events)
    return 1 - sum(e.end - e.start for e in events) / (len(ranks) * (end - start))


def stub(*args):
    """What the released notebook holds: the solution replaced."""
    raise NotImplementedError()


# -------------------------------------------------------------- wrong solutions
def forward_to_every_next_rank(stage, micro_batch):
    """The last stage sends too: to rank world_size, a stage that does not exist."""
    rank = dist.get_rank()
    x = micro_batch
    if rank > 0:
        x = torch.empty_like(micro_batch)
        dist.recv(x, src=rank - 1)
    y = stage(x)
    dist.send(y.detach(), dst=rank + 1)
    return y


def forward_skipping_a_stage(stage, micro_batch):
    """Stage 0 sends to rank 2, past stage 1, which waits for it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = micro_batch
    if rank > 0:
        x = torch.empty_like(micro_batch)
        dist.recv(x, src=rank - 1)
    y = stage(x)
    if rank < world_size - 1:
        dist.send(y.detach(), dst=rank + 2 if rank == 0 else rank + 1)
    return y


def forward_without_wait(stage, micro_batch):
    """irecv whose request is dropped: a missing wait."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = micro_batch
    if rank > 0:
        x = torch.zeros_like(micro_batch)
        dist.irecv(x, src=rank - 1)
    y = stage(x)
    if rank < world_size - 1:
        dist.send(y.detach(), dst=rank + 1)
    return y


def forward_with_pipeline_stage(stage, micro_batch):
    from torch.distributed.pipelining import PipelineStage

    PipelineStage(stage, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    return pipeline_forward(stage, micro_batch)


def gpipe_in_batches(stage, inputs, targets):
    """One micro-batch's exchange as dist.batch_isend_irecv: refused (the exercise pairs them)."""
    rank = dist.get_rank()
    if rank == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs[0], 1)])
    gpipe_step(stage, inputs, targets)


def one_f_one_b_with_torch(stage, inputs, targets):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world_size = dist.get_rank(), dist.get_world_size()
    schedule = Schedule1F1B(PipelineStage(stage, rank, world_size, torch.device("cpu")),
                            n_microbatches=len(inputs), loss_fn=pipeline.loss_fn)
    schedule.step(torch.cat(inputs)) if rank == 0 else schedule.step(target=torch.cat(targets))


def gpipe_not_averaged(stage, inputs, targets):
    _schedule(stage, inputs, targets, "gpipe", scale=False)


def gpipe_not_accumulated(stage, inputs, targets):
    _schedule(stage, inputs, targets, "gpipe", zero_between=True)


def gpipe_gradient_to_the_next_stage(stage, inputs, targets):
    _schedule(stage, inputs, targets, "gpipe", back_to=+1)


def one_f_one_b_receiving_first(stage, inputs, targets):
    """Stage 0 waits for a gradient before sending any activation; stage 1 for an activation."""
    rank = dist.get_rank()
    grad = torch.empty_like(inputs[0])
    if rank == 0:
        dist.recv(grad, src=1)
    one_f_one_b_step(stage, inputs, targets)


def one_f_one_b_with_blocking_sends(stage, inputs, targets):
    """1F1B with dist.send: in the steady state stage 0 sends an activation while stage 1 sends a
    gradient back, and gloo's send returns only once its receive is posted."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    m = len(inputs)
    held = {}

    def forward(i):
        x = inputs[i]
        if rank > 0:
            x = torch.empty_like(inputs[i])
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank < world_size - 1:
            dist.send(y.detach(), dst=rank + 1)
        held[i] = (x, y)

    def backward(i):
        x, y = held.pop(i)
        if rank == world_size - 1:
            (pipeline.loss_fn(y, targets[i]) / m).backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, src=rank + 1)
            y.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)

    warmup = min(world_size - 1 - rank, m)
    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)


def bubble_per_rank_span(events):
    ranks = sorted({e.rank for e in events})
    busy = sum(e.end - e.start for e in events)
    spans = sum(max(e.end for e in events if e.rank == r) - min(e.start for e in events if e.rank == r)
                for r in ranks)
    return 1 - busy / spans


def bubble_forwards_only(events):
    return bubble_fraction([e for e in events if e.op != "backward"])


# --------------------------------------------------------------------- the tests


def test_pipeline_forward_reference_passes(fresh_lab, capsys):
    check.pipeline_forward(pipeline_forward)
    assert "Correct: pipeline_forward passes a micro-batch through 2 stages" in capsys.readouterr().out


@pytest.mark.parametrize("checker", ["pipeline_forward", "gpipe", "one_f_one_b", "bubble_fraction"])
def test_the_stub_fails_with_not_implemented(fresh_lab, checker):
    message = fails(lambda: getattr(check, checker)(stub), "in stub)", "It raised ")
    assert message.startswith("NotImplementedError ("), message


@pytest.mark.parametrize("checker, answer", [("pipeline_forward", "forward_with_pipeline_stage"),
                                             ("one_f_one_b", "one_f_one_b_with_torch")])
def test_torchs_pipelining_is_refused(fresh_lab, checker, answer):
    fails(lambda: getattr(check, checker)(globals()[answer]),
          "may not use torch's torch.distributed.pipelining")


def test_pipeline_forward_wrong_stage_named(fresh_lab):
    message = fails(lambda: check.pipeline_forward(forward_to_every_next_rank),
                    "rank 1 sent a micro-batch to rank 2", "a micro-batch sent to the wrong stage")
    assert "Correct" not in message
    assert fresh_lab.healthy


def test_pipeline_forward_skipping_a_stage_named_and_the_stuck_lab_restarted(fresh_lab4):
    message = fails(lambda: check.pipeline_forward(forward_skipping_a_stage),
                    "rank 0 sent a micro-batch to rank 2 (dist.send(dst=2))", "wrong stage",
                    "The check restarted the lab")
    assert "rank 1: still in recv" in message           # the stage it skipped, waiting for it
    assert fresh_lab4.healthy


def test_pipeline_forward_missing_wait_named(fresh_lab):
    fails(lambda: check.pipeline_forward(forward_without_wait), "a missing wait",
          "rank 1: got dist.irecv(src=0) never waited on")


def test_gpipe_reference_passes(fresh_lab, capsys):
    check.gpipe(gpipe_step)
    assert "every stage held 4 activations at once" in capsys.readouterr().out


def test_gpipe_library_batch_isend_irecv_refused(fresh_lab):
    fails(lambda: check.gpipe(gpipe_in_batches), "may not use torch's batch_isend_irecv")


@pytest.mark.parametrize("wrong, why", [
    (gpipe_not_averaged, "m times too large"),
    (gpipe_not_accumulated, "not accumulated over the micro-batches"),
])
def test_gpipe_wrong_gradients_named(fresh_lab, wrong, why):
    message = fails(lambda: check.gpipe(wrong), "after the first step, rank", why)
    assert "Hint:" in message


def test_gpipe_wrong_stage_named(fresh_lab):
    fails(lambda: check.gpipe(gpipe_gradient_to_the_next_stage),
          "rank 1 sent a micro-batch to rank 2", "wrong stage")


def test_gpipe_rejects_a_1f1b_order(fresh_lab):
    fails(lambda: check.gpipe(one_f_one_b_step), "rank 0 ran its forwards (F) and backwards (B)",
          "GPipe runs all 4 forwards, then all 4 backwards")


def test_one_f_one_b_reference_passes(fresh_lab, capsys):
    check.one_f_one_b(one_f_one_b_step)
    assert "holding at most 2, 1 activations on ranks 0..1" in capsys.readouterr().out


def test_one_f_one_b_rejects_gpipe_naming_the_activations_held(fresh_lab):
    message = fails(lambda: check.one_f_one_b(gpipe_step),
                    "it held 4 micro-batches' activations at once; 1F1B holds at most 2 on rank 0")
    assert "F0 F1 F2 F3 B0 B1 B2 B3" in message


@pytest.mark.parametrize("deadlocked, op", [(one_f_one_b_receiving_first, "recv"),
                                             (one_f_one_b_with_blocking_sends, "send")])
def test_one_f_one_b_deadlock_reported_within_the_check_timeout_naming_rank_and_op(fresh_lab, monkeypatch,
                                                                                   deadlocked, op):
    assert check.TIMEOUT == 15.0                    # what a student waits for
    monkeypatch.setattr(check, "TIMEOUT", 5.0)      # the shortest that still shows the hang
    start = time.monotonic()
    message = fails(lambda: check.one_f_one_b(deadlocked),
                    "did not finish: the ranks are waiting", "(a deadlock)", f"rank 0: still in {op}",
                    f"rank 1: still in {op}", "Hint:", "The check restarted the lab")
    took = time.monotonic() - start
    assert took < 3 * check.TIMEOUT, took          # the check's timeout, not the lab's
    assert "1F1B's steady state" in message
    assert fresh_lab.healthy                          # restarted by the check: usable at once
    assert fresh_lab.run(lambda: dist.get_world_size()) == [2, 2]


def test_bubble_fraction_reference_passes(fresh_lab, capsys):
    check.bubble_fraction(bubble_fraction)
    assert "Correct: bubble_fraction measures the idle share of a step on 4 timelines" in \
        capsys.readouterr().out


@pytest.mark.parametrize("wrong, why", [
    (bubble_per_rank_span, "from its own first to its own last compute"),
    (bubble_forwards_only, "it left out the backwards"),
])
def test_bubble_fraction_wrong_measures_named(fresh_lab, wrong, why):
    fails(lambda: check.bubble_fraction(wrong), "is wrong: got", why)


def test_simulated_bubble_is_the_formula_and_1f1b_holds_p_minus_rank():
    for p, m in [(2, 1), (4, 4), (4, 9), (8, 3)]:
        for name in ("GPipe", "1F1B"):
            timeline = pipeline.simulate(name, p, m)
            assert abs(pipeline.bubble(timeline) - (p - 1) / (m + p - 1)) < 1e-12
        held = [pipeline.live_activations([(k, i) for k, i, _, _ in ops])
                for ops in pipeline.simulate("1F1B", p, m).values()]
        assert held == [min(p - r, m) for r in range(p)]


def test_simulate_names_the_ranks_of_an_order_that_deadlocks():
    order = {0: [("B", 0), ("F", 0)], 1: [("F", 0), ("B", 0)]}
    with pytest.raises(RuntimeError, match="rank 0 at B0, rank 1 at F0"):
        pipeline.simulate(order, 2, 1)


# Issue 46: a pipeline's messages for show, the answer computed by each rank alone. It passed while
# every rank was given the micro-batch and could make every stage (pipeline.model(world_size)).
def pipeline_forward_computed_alone(stage, micro_batch):
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank > 0:
        dist.recv(torch.empty_like(micro_batch), src=rank - 1)
    whole, y = pipeline.model(p), micro_batch
    for r in range(rank):
        y = whole[r](y)
    y = stage(y)
    if rank < p - 1:
        dist.send(y.detach(), dst=rank + 1)
    return y


def test_pipeline_forward_computed_by_each_rank_alone_does_not_pass(fresh_lab):
    fails(lambda: check.pipeline_forward(pipeline_forward_computed_alone),
          "pipeline_forward: rank 1 did not return the output of stages 0..1",
          "  rank 1: got 24 of 24 elements differ")     # its values against the reference, not a shape


_ALONE = {}


def gpipe_computed_alone(stage, inputs, targets):
    """GPipe's messages and order on zeros; each stage's gradients from the whole model, which
    every rank could make (and keep in step with the check's SGD), on the batch every rank held."""
    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(inputs)
    if _ALONE.get("stage") is not stage:
        _ALONE.update(stage=stage, whole=pipeline.model(p))
    whole, requests, outs = _ALONE["whole"], [], []
    for i in range(m):
        x = torch.zeros_like(inputs[i])
        if rank > 0:
            dist.irecv(x, src=rank - 1).wait()
        outs.append(stage(x.requires_grad_()))
        if rank < p - 1:
            requests.append(dist.isend(torch.zeros_like(x), dst=rank + 1))
    for i in range(m):
        grad = torch.zeros_like(outs[i])
        if rank < p - 1:
            dist.irecv(grad, src=rank + 1).wait()
        outs[i].backward(grad)
        if rank > 0:
            requests.append(dist.isend(torch.zeros_like(inputs[i]), dst=rank - 1))
    for request in requests:
        request.wait()
    loss = pipeline.loss_fn(whole(torch.cat(inputs)), torch.cat(targets))
    grads = torch.autograd.grad(loss, list(whole.parameters()))
    mine = dict(zip(whole.parameters(), grads))
    with torch.no_grad():
        for q, w in zip(stage.parameters(), whole[rank].parameters()):
            q.grad.copy_(mine[w])
        for w, g in mine.items():                # the check's SGD step, on every stage
            w -= 0.5 * g


def test_gpipe_computed_by_each_rank_alone_does_not_pass(fresh_lab):
    fails(lambda: check.gpipe(gpipe_computed_alone),
          "gpipe: after the first step, rank 0's gradients are")
