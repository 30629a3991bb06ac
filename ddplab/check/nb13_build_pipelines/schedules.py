"""Checkers for notebook 13, pipeline parallelism by hand.

    ddplab.check.pipeline_forward(my_pipeline_forward)   # one micro-batch through every stage
    ddplab.check.gpipe(my_gpipe_step)                    # all forwards, then all backwards
    ddplab.check.one_f_one_b(my_one_f_one_b_step)        # warm-up forwards, then one forward, one backward
    ddplab.check.bubble_fraction(my_bubble_fraction)     # the idle share of a step, from tr.compute

The schedules run on every rank as ``fn(stage, inputs, targets)``: stage = rank
of ``ddplab.pipeline.model(world_size, seed)`` (float64), ``m`` micro-batches. After
each of 3 steps the check takes an SGD step itself, and compares each rank's
weights with one process training the whole model on the whole batch (1e-12).
Before that it says what went wrong, by what it saw: a micro-batch sent to a
rank that is not the next or previous stage, a request never waited on,
gradients ``m`` times too large (not averaged) or of one micro-batch only (not
accumulated), a forward and backward order that is not the schedule's. A hang
fails within ``TIMEOUT`` s naming where each rank is stuck; the check then
restarts the lab. ``torch.distributed.pipelining``, ``batch_isend_irecv`` and
every collective are refused during the student's call. The model's weights and
the batches are drawn for each check from seeds no rank sees; each rank is sent
only its stage's block, and the inputs only to stage 0, the targets only to the
last (the others get zeros of their shapes): a stage learns what another holds
only from the messages of the pipeline. ``bubble_fraction``'s own answer is the
answer key ``pipelines`` (``ddplab.check._keys``), loaded inside the check.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _keys
from .._core import answers_of, checker, passed, run_on_ranks, run_student_code, student_raised
from .._feedback import Feedback, Row
from . import _stages

__all__ = ["bubble_fraction", "gpipe", "one_f_one_b", "pipeline_forward"]

#: Seconds one call of a student's schedule may take before the ranks are reported as deadlocked.
TIMEOUT = 15.0
STEPS, MICRO_BATCHES = 3, 4
# Said where the lab sees no pattern of its own (all in send, all in recv).
HANG_HINT = ("neighbouring stages must order their sends and receives so that one side can start: "
             "in 1F1B's steady state an activation goes forward while a gradient comes back. Post "
             "sends with dist.isend and wait() on the requests later; receive what the neighbour "
             "sends in the order it sends it.")


#: What the lab's messages advise after a hang, which the check has done when it restarted the lab.
_RECOVER = ("Then recover with: lab.restart()",
            "Those ranks cannot be freed from inside. Recover with: lab.restart()")


def _run(what: str, lab: Any, fn: Callable, *args: Any, each: dict[int, tuple]) -> list[Any]:
    """``fn(*args, *each[rank])`` on every rank, sent only its own ``each[rank]``; results by rank.

    A failure or hang becomes a ``Feedback``, and a stuck lab is restarted.
    """
    __tracebackhide__ = True
    run_on_ranks(_stages.warm, *args[:1], lab=lab, timeout=120.0)   # args[0]: the student's function
    try:
        got = run_student_code(what, fn, *args, lab=lab, timeout=TIMEOUT, hint=HANG_HINT, each=each)
        return [got[rank] for rank in range(lab.world_size)]
    except Feedback as error:
        if lab.healthy or lab.controller_pid is None:    # no controller of its own: the grader's
            raise                                          # view of a lab, never restarted by a check
        try:
            lab.restart()
        except Exception:  # noqa: BLE001 - the lab could not restart: the student's lab.restart() will say why
            raise error from None
        hint, detail = error.hint, [line for line in error.detail if line.strip() not in _RECOVER]
        for advice in _RECOVER:                      # done: the check restarted it
            hint = hint.replace(advice, "").strip()
        raise Feedback(error.headline, rows=error.rows, hint=hint,
                       detail=[*detail, "(The check restarted the lab: its ranks are fresh.)"]) from None


def _need(fn: Any, name: str) -> None:
    if not callable(fn):
        raise Feedback(f"ddplab.check.{name} needs your function; got {fn!r}.",
                       hint=f"pass it, as in ddplab.check.{name}(my_{name}).")


def _unwaited(exercise: str, got: list[dict]) -> None:
    late = {rank: g["unwaited"] for rank, g in enumerate(got) if g["unwaited"]}
    if late:
        raise Feedback(f"{exercise}: a missing wait. Requests that dist.isend / dist.irecv returned "
                       f"were never waited on.",
                       rows=[Row(rank, f"{', '.join(sorted(set(what)))} never waited on", wrong=True)
                             for rank, what in late.items()],
                       hint="an irecv's tensor holds the message only after its wait(); an isend's "
                            "tensor may not be changed or dropped before its wait(). Keep every "
                            "request and wait() on it before the step ends.")


def _messages(exercise: str, p: int, counts: list[dict], m: int, backward: bool) -> None:
    """Stage r sends m activations to r + 1 and, with ``backward``, m gradients to r - 1; and receives
    the same from the other side."""
    wrong = []
    for rank, c in enumerate(counts):
        ahead = {rank + 1: m} if rank < p - 1 else {}
        behind = {rank - 1: m} if rank > 0 else {}
        expected = {"sent": {**ahead, **(behind if backward else {})},
                    "received": {**behind, **(ahead if backward else {})}}
        for kind, word in (("sent", "to"), ("received", "from")):
            if c[kind] != expected[kind]:
                said = ", ".join(f"{n} {word} rank {r}" for r, n in sorted(c[kind].items()))
                wrong.append(f"  rank {rank} {kind} {said or 'nothing'}")
    if wrong:
        rule = (f"Every stage but the last sends each of the {m} micro-batches' activations to the "
                f"next stage once, and every stage but the first sends the gradient of each "
                f"micro-batch's input back once." if backward else
                "Every stage but the last sends its activation to the next stage once.")
        raise Feedback(f"{exercise}: the messages are not a pipeline's on {p} stages.",
                       detail=[*wrong, rule])


@checker
def pipeline_forward(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(stage, micro_batch)``: receive from the previous stage, run the stage, send on."""
    __tracebackhide__ = True
    import torch

    from .._feedback import spell_against

    _need(fn, "pipeline_forward")
    p = lab.world_size
    whole, batches = _stages.drawn(p, 1, 1, rows=3)
    sent = {rank: _stages.sent_to(rank, p, whole, batches) for rank in range(p)}
    got = _run("pipeline_forward(stage, micro_batch)", lab, _stages.forward_once, fn,
               "pipeline_forward", each={rank: (w, b[0][0][0]) for rank, (w, b) in sent.items()})
    _unwaited("pipeline_forward", got)
    _messages("pipeline_forward", p, got, 1, backward=False)
    out = batches[0][0][0]
    for rank in range(p):
        out = whole[rank](out)
        mine = got[rank]["output"]
        if not isinstance(mine, torch.Tensor) or mine.shape != out.shape or \
                not torch.allclose(mine, out.detach(), atol=1e-12, rtol=0):
            raise Feedback(
                f"pipeline_forward: rank {rank} did not return the output of stages 0..{rank} on "
                f"the micro-batch (compared with one process at 1e-12).",
                rows=[Row(rank, spell_against(out.detach(), mine), wrong=True)],
                hint="rank 0 runs its stage on the micro-batch; every other rank receives its input "
                     "from the previous stage (into a tensor of the micro-batch's shape and dtype) "
                     "and runs its stage on that; every rank returns its stage's output.")
    passed(f"pipeline_forward passes a micro-batch through {p} stages, one message per stage, "
           f"and the last stage's output equals the whole model's.")


def _check_training(exercise: str, fn: Callable, lab: Any,
                    order: Callable[[int, int, int, list], tuple[str, str] | None]):
    """Run ``fn`` for STEPS steps on every rank and compare; ``order(rank, p, m)`` judges its log."""
    __tracebackhide__ = True
    _need(fn, exercise)
    p, m = lab.world_size, MICRO_BATCHES
    whole, batches = _stages.drawn(p, STEPS, m)
    got = _run(f"{exercise}(stage, inputs, targets)", lab, _stages.train, fn, exercise,
               each={rank: _stages.sent_to(rank, p, whole, batches) for rank in range(p)})
    _unwaited(exercise, got)
    _messages(exercise, p, [g["messages"][0] for g in got], m, backward=True)
    weights, first, wrong = _stages.reference(whole, batches)
    for rank, g in enumerate(got):
        if any(q is None for q in g["grads"]):
            raise Feedback(f"{exercise}: after the step, some parameters of rank {rank}'s stage have "
                           f"no gradient (.grad is None): its backward never ran.",
                           hint="every stage calls backward on each micro-batch: the last on its "
                                "loss, the others on their output with the gradient received.")
        if not _stages.close(g["grads"], first[rank]):
            said = next((why for why, grads in wrong.items()
                         if _stages.close(g["grads"], grads[rank], 1e-10)),
                        "not the whole batch's (compared with one process at 1e-12)")
            raise Feedback(f"{exercise}: after the first step, rank {rank}'s gradients are {said}.",
                           hint=f"the loss of the batch is the mean of the {m} micro-batches' "
                                f"losses; backward adds into .grad, so the micro-batches' gradients "
                                f"accumulate by themselves.")
    for rank, g in enumerate(got):
        problem = order(rank, p, m, g["logs"][0])
        if problem:
            raise Feedback(f"{exercise}: rank {rank} ran its forwards (F) and backwards (B) in the "
                           f"order {' '.join(k + str(i) for k, i in g['logs'][0])}: {problem[0]}",
                           hint=problem[1])
    for rank, g in enumerate(got):
        if not _stages.close(g["weights"], weights[rank]):
            raise Feedback(f"{exercise}: after {STEPS} steps rank {rank}'s weights differ from one "
                           f"process trained on the whole batch (1e-12), though the first step's "
                           f"gradients matched.",
                           hint="each step must start from the gradients of that step only.")
    return got


def _gpipe_order(rank: int, p: int, m: int, log: list) -> tuple[str, str] | None:
    kinds = "".join(k for k, _ in log)
    if kinds != "F" * m + "B" * m:
        return (f"GPipe runs all {m} forwards, then all {m} backwards, on every stage.",
                "loop over the micro-batches forward first, keeping each one's input and output; "
                "then loop again for the backwards.")
    return None


@checker
def gpipe(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(stage, inputs, targets)``: GPipe, all forwards then all backwards."""
    __tracebackhide__ = True
    got = _check_training("gpipe", fn, lab, _gpipe_order)
    peak = max(_live(g["logs"][0]) for g in got)
    passed(f"gpipe trains like one process on the whole batch ({STEPS} steps, {MICRO_BATCHES} "
           f"micro-batches, {len(got)} stages, 1e-12); every stage held {peak} activations at once.")


def _live(log: list) -> int:
    from ddplab import pipeline
    return pipeline.live_activations(log)


def _one_f_one_b_order(rank: int, p: int, m: int, log: list) -> tuple[str, str] | None:
    limit, peak = min(p - rank, m), _live(log)
    if peak > limit:
        return (f"it held {peak} micro-batches' activations at once; 1F1B holds at most {limit} on "
                f"rank {rank} (p - rank, with p = {p} stages).",
                "after its warm-up forwards, a stage alternates: one forward, then the backward of "
                "its oldest micro-batch.")
    first_b = next((i for i, (k, _) in enumerate(log) if k == "B"), len(log))
    kinds = "".join(k for k, _ in log)
    rest = kinds[first_b:]
    if first_b != limit or "FF" in rest or any(i != j for j, (_, i) in
                                              enumerate(e for e in log if e[0] == "B")):
        return (f"not 1F1B's order: rank {rank} runs {limit} forwards before its first backward "
                f"(p - rank, capped at m), then alternates one backward, one forward, backwards in "
                f"micro-batch order.",
                "warm-up forwards first, then a backward and a forward in turn, then the remaining "
                "backwards.")
    return None


@checker
def one_f_one_b(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(stage, inputs, targets)``: 1F1B, at most p - rank activations held on rank."""
    __tracebackhide__ = True
    got = _check_training("one_f_one_b", fn, lab, _one_f_one_b_order)
    peaks = [_live(g["logs"][0]) for g in got]
    passed(f"one_f_one_b trains like one process on the whole batch ({STEPS} steps, "
           f"{MICRO_BATCHES} micro-batches, {len(got)} stages, 1e-12), holding at most "
           f"{', '.join(map(str, peaks))} activations on ranks 0..{len(got) - 1}.")


# ------------------------------------------------------------------ the bubble
def _per_rank_span(events: list) -> float:
    ranks = sorted({e.rank for e in events})
    spans = [max(e.end for e in events if e.rank == r) - min(e.start for e in events if e.rank == r)
             for r in ranks]
    return 1 - sum(e.end - e.start for e in events) / sum(spans)


def _timeline(p: int, m: int, f: float, b: float, order: str, t0: float = 0.25) -> list:
    """tr.compute of one step of a perfect pipeline on one clock: F and B regions per rank."""
    from ddplab.pipeline import simulate
    from ddplab.trace import Event

    return [Event(index=-1, rank=r, op=("F" + str(i)) if k == "F" else "backward", kind="compute",
                  start=t0 + s, end=t0 + e)
            for r, ops in simulate(order, p, m, f, b).items() for k, i, s, e in ops]


@checker(needs_lab=False)
def bubble_fraction(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(events)``: the bubble of one step, from a trace's compute events (``tr.compute``)."""
    __tracebackhide__ = True
    _need(fn, "bubble_fraction")
    cases = [(4, 4, 0.01, 0.02, "gpipe"), (2, 8, 0.01, 0.02, "1f1b"), (4, 4, 0.01, 0.01, "1f1b"),
             (3, 2, 0.02, 0.05, "gpipe")]
    timelines = [_timeline(*case) for case in cases]
    answers = answers_of(fn, [(events,) for events in timelines], lab)
    bubble = _keys.load("pipelines").bubble
    for (p, m, _, _, order), events, answer in zip(cases, timelines, answers):
        what = f"bubble_fraction of a {order} step on {p} stages, {m} micro-batches"
        if answer[0] != "ok":
            raise student_raised(what, answer)
        got, expected = answer[1], bubble(events)
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-9:
            why = ("it measured each rank from its own first to its own last compute: the time "
                   "a stage waits before its first forward and after its last backward is "
                   "bubble too. Measure every rank over the whole step (earliest start to latest "
                   "end, over all ranks)" if isinstance(got, float) and
                   abs(got - _per_rank_span(events)) < 1e-9 else
                   "it left out the backwards: a backward (op 'backward') is work too"
                   if isinstance(got, float) and
                   abs(got - bubble([e for e in events if e.op != "backward"])) < 1e-9 else
                   "a fraction between 0 and 1 of the p x step time in which no compute ran")
            raise Feedback(f"{what} is wrong: got {got!r}.", hint=f"{why}.")
    passed(f"bubble_fraction measures the idle share of a step on {len(cases)} timelines "
           f"(GPipe and 1F1B, 2 to 4 stages).")
