"""Checkers for notebook 15, at scale: the planner's numbers by hand.

    ddplab.check.predict_step(my_predict_step)              # compute + a ring all_reduce, by α-β
    ddplab.check.fits_budget(my_fits_budget)                # the strategy a memory budget allows
    ddplab.check.bubble_microbatches(my_bubble_microbatches)  # micro-batches for a bubble under a target
    ddplab.check.replay_growth(my_replay_growth)            # what a replay at N ranks made longer

Each exercise is a plain function, called (on rank 0 of the running lab, as
``answers_of`` does) with inputs the check draws, never the notebook's own: a
number copied from the notebook fails. The check computes the answer its own
way (the α-β formula, the plan's rows, the bubble formula, ``tr.replay``) and,
when the student's differs, says which plausible mistake it matches: the
(N-1)/N factor or the 2 of a ring all_reduce left out, the fastest strategy
taken whether it fits or not, (p-1)/m for the bubble, a trace compared with its
recording rather than its replay. It never prints the expected answer, nor a
formula that is the answer. The inputs it draws: ``_inputs``; its own answers are
the answer key ``scale`` (``ddplab.check._keys``), loaded inside each check.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable

from .. import _keys
from .._core import answers_of, checker, passed, student_raised
from .._feedback import Feedback
from ._inputs import BUBBLES, STEPS, fits_cases, replay_calls

__all__ = ["bubble_microbatches", "fits_budget", "predict_step", "replay_growth"]


def _need(fn: Any, name: str) -> None:
    if not callable(fn):
        raise Feedback(f"ddplab.check.{name} needs your function; got {fn!r}.",
                       hint=f"pass it, as in ddplab.check.{name}(my_{name}).")


def _answers(fn: Callable, name: str, calls: list[tuple]) -> list[Any]:
    """The student's answers; one that raised becomes a ``Feedback`` naming its call."""
    out = []
    for args, answer in zip(calls, answers_of(fn, calls)):
        if answer[0] != "ok":
            raise student_raised(f"{name}{_spell_args(args)}", answer)
        out.append(answer[1])
    return out


def _named(mistakes: list[tuple[str, Callable]], wrong: list[tuple[tuple, Any]],
           same: Callable[[Any, Any], bool], every: bool = False) -> str | None:
    """The mistake that gives every wrong answer (``(args, got)``), else (unless ``every``)
    the first wrong one's."""
    def matches(mistake: Callable, args: tuple, got: Any) -> bool:
        try:
            return same(got, mistake(*args))
        except (ValueError, TypeError, AttributeError, ZeroDivisionError):
            return False
    for text, mistake in mistakes:
        if all(matches(mistake, args, got) for args, got in wrong):
            return text
    return None if every else next((text for text, mistake in mistakes if matches(mistake, *wrong[0])),
                                   None)


def _spell_args(args: tuple) -> str:
    def one(a: Any) -> str:
        if isinstance(a, float):
            return f"{a:.3g}"
        if isinstance(a, (int, str)) or a is None:
            return repr(a)
        return f"<{len(a)} rows>" if isinstance(a, list) else f"<a {type(a).__name__}>"
    return "(" + ", ".join(map(one, args)) + ")"


def _close(a: Any, b: float, rel: float = 1e-9) -> bool:
    return isinstance(a, (int, float)) and math.isclose(float(a), b, rel_tol=rel, abs_tol=1e-15)


# ------------------------------------------------------------ a step by hand
def _step_mistakes(ring: Callable[..., float]) -> list[tuple[str, Callable[..., float]]]:
    """The named mistakes of a step's time; ``ring``: the key's all_reduce time."""
    return [
        ("the compute is missing: a step is flops / flop_rate of compute and then the all_reduce "
         "(on these CPU ranks nothing hides behind compute)",
         lambda f, r, s, n, a, b: ring(n, s, a, b)),
        ("the communication is missing: the gradients' all_reduce takes time too",
         lambda f, r, s, n, a, b: f / r),
        ("the (N-1)/N factor is missing from the bytes: in a ring each rank sends 2(N-1) pieces of "
         "S/N bytes, not 2 whole tensors",
         lambda f, r, s, n, a, b: f / r + 2 * (n - 1) * a + 2 * s * b),
        ("the bytes term counts whole tensors: 2(N-1) steps of S/N bytes each is 2(N-1)/N x S, "
         "not 2(N-1) x S",
         lambda f, r, s, n, a, b: f / r + 2 * (n - 1) * (a + s * b)),
        ("the 2 is missing: a ring all_reduce is a reduce-scatter then an all-gather, each "
         "(N-1) steps; you timed only one of them",
         lambda f, r, s, n, a, b: f / r + (n - 1) * a + (n - 1) / n * s * b),
        ("the latency is missing: each of the 2(N-1) steps costs α besides its bytes",
         lambda f, r, s, n, a, b: f / r + 2 * (n - 1) / n * s * b),
        ("α is counted once, not once per step: the ring takes 2(N-1) steps, each one message",
         lambda f, r, s, n, a, b: f / r + a + 2 * (n - 1) / n * s * b),
        ("the compute and the all_reduce overlap in your answer (the larger of the two): on ranks "
         "whose collectives share the cores with the compute, add them",
         lambda f, r, s, n, a, b: max(f / r, ring(n, s, a, b))),
    ]


def _without_planner(fn: Callable, *args: Any) -> Any:
    """Where the student's function runs: ``fn(*args)`` with the planner's α-β cost refused
    (``Network.seconds``, however it was imported): the exercise is that formula."""
    from ddplab.plan.network import Network

    own = Network.seconds

    def refused(*_: Any, **__: Any) -> float:
        raise Feedback("my_predict_step may not call the planner's Network.seconds.",
                       hint="write the ring's α-β cost yourself: that is the exercise.")
    Network.seconds = refused
    try:
        return fn(*args)
    finally:
        Network.seconds = own


@checker(needs_lab=False)
def predict_step(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(flops, flop_rate, grad_bytes, world_size, alpha, beta)``: seconds of one
    data-parallel step, compute then a ring all_reduce of the gradients, nothing overlapped."""
    __tracebackhide__ = True
    _need(fn, "predict_step")
    answers = _answers(functools.partial(_without_planner, fn), "predict_step", STEPS)
    scale = _keys.load("scale")
    wrong = [(args, got) for args, got in zip(STEPS, answers)
             if not _close(got, scale.step(*args))]
    if wrong:
        args, got = wrong[0]
        why = _named(_step_mistakes(scale.ring), wrong, _close) or \
            ("a step on these ranks is the compute (the FLOPs at the flop rate) and then one ring "
             "all_reduce of the gradients, timed by α-β, nothing hidden")
        raise Feedback(f"predict_step{_spell_args(args)} is wrong: got {got!r}.", hint=f"{why}.")
    passed(f"predict_step times compute plus a ring all_reduce by α-β on {len(STEPS)} "
           f"machines (2 to 1024 ranks).")


# ------------------------------------------------------------ what fits
def _fits_mistakes(fits_by: Callable[..., str | None]) -> list[tuple[str, Callable[[list, float], Any]]]:
    """The named mistakes of a budget's strategy; ``fits_by``: the key's, by any size."""
    return [
        ("it is the fastest strategy, and it does not fit: keep only the rows whose peak is within "
         "the budget, then take the fastest of those",
         lambda rows, budget: max((r for r in rows if not r.error), key=lambda r: r.tokens_per_s).strategy),
        ("its parameters, gradients, optimizer state and activations fit, but not its peak: "
         "temporaries (gathered shards, the backward's buffers) come on top; compare row.peak",
         lambda rows, budget: fits_by(rows, budget, lambda r: sum(r.memory.values()))),
        ("it is the smallest, not the fastest that fits: of the rows that fit, take the most "
         "tokens per second",
         lambda rows, budget: min((r for r in rows if not r.error), key=lambda r: r.peak).strategy),
        ("it has the shortest step, but steps of different strategies train different batches "
         "(tp and pp make fewer replicas): compare row.tokens_per_s",
         lambda rows, budget: min((r for r in rows if not r.error and r.peak <= budget),
                                  key=lambda r: r.step.total).strategy),
        ("that row has no numbers: its strategy cannot run at this size (row.error says why); "
         "a row with an error fits nothing",
         lambda rows, budget: next((r.strategy for r in rows if r.error), "")),
    ]


@checker(needs_lab=False)
def fits_budget(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(rows, budget)``: of a plan's rows at one world size, the strategy whose peak
    fits ``budget`` bytes per rank and trains the most tokens per second; None if none fits."""
    __tracebackhide__ = True
    _need(fn, "fits_budget")
    cases = fits_cases()
    answers = _answers(fn, "fits_budget", cases)
    scale = _keys.load("scale")
    mistakes = _fits_mistakes(scale.fits_by)
    wrong = [((rows, budget), got) for (rows, budget), got in zip(cases, answers)
             if got != scale.fits_right(rows, budget)]
    if wrong:
        same = operator.eq
        none = [(args, got) for args, got in wrong if scale.fits_right(*args) is None]
        (rows, budget), got = (none or wrong)[0]
        why = _named(mistakes, wrong, same, every=True)
        if why is None and none:
            why = ("nothing fits this budget: return None" +
                   ("; a row with an error has no numbers (its peak is 0), it fits nothing"
                    if any(r.error and r.strategy == got for r in rows) else ""))
        elif why is None:
            why = _named(mistakes, wrong, same) or \
                ("return the strategy name (row.strategy) of the row that fits (row.peak <= budget, "
                 "no row.error) with the most row.tokens_per_s")
        else:
            (rows, budget), got = wrong[0]
        raise Feedback(f"fits_budget(<rows: {', '.join(r.strategy for r in rows)}>, "
                       f"{budget / 1e9:g} GB) is wrong: got {got!r}.", hint=f"{why}.")
    passed(f"fits_budget picks the fastest strategy that fits, on {len(cases)} budgets at 64 ranks.")


# ------------------------------------------------------------ the bubble
def _bubble_mistakes(scale: Any) -> list[tuple[str, Callable[..., Any]]]:
    """The named mistakes of the micro-batches; ``scale``: the key (``smallest``, ``share``)."""
    smallest, share = scale.smallest, scale.share
    return [
        ("that brings the bubble over the *compute*, (p-1)/m, the planner's, under the target: the "
         "share that counts is of the whole step, which is compute plus bubble",
         lambda p, batch, t: smallest(p, batch, t, lambda p, m: (p - 1) / m)),
        ("that makes the bubble *at most* the target, not under it: at exactly the target keep going",
         lambda p, batch, t: smallest(p, batch, t, share, under=False)),
        ("the micro-batches must split the replica's batch evenly: m has to divide the batch",
         lambda p, batch, t: next((m for m in range(1, 100 * batch) if share(p, m) < t), None)),
    ]


@checker(needs_lab=False)
def bubble_microbatches(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(p, batch, target)``: the fewest micro-batches m that divide ``batch`` and make
    the 1F1B bubble (p-1)/(m+p-1) smaller than ``target``; None if no m does."""
    __tracebackhide__ = True
    _need(fn, "bubble_microbatches")
    answers = _answers(fn, "bubble_microbatches", BUBBLES)
    scale = _keys.load("scale")
    for args, got in zip(BUBBLES, answers):
        expected = scale.smallest(*args, scale.share)
        if got == expected and (got is None or isinstance(got, int)):
            continue
        if expected is None:
            why = ("no m that divides this batch brings the bubble under the target: return None "
                   "(the fix at scale is a bigger batch per replica, or fewer stages)")
        else:
            why = next((text for text, wrong in _bubble_mistakes(scale) if wrong(*args) == got),
                       "the fewest micro-batches that divide the batch and bring the bubble's "
                       "share of the whole step (idle over compute plus idle) under the target; "
                       "one stage has no bubble")
        raise Feedback(f"bubble_microbatches{_spell_args(args)} is wrong: got {got!r}.",
                       hint=f"{why}.")
    passed(f"bubble_microbatches finds the fewest micro-batches under the target bubble for "
           f"{len(BUBBLES)} pipelines (1 to 16 stages).")


# ------------------------------------------------------------ a replay
def _same(got: Any, expected: dict[str, float]) -> bool:
    if not isinstance(got, dict) or not set(expected) <= set(got):
        return False
    extra = [v for k, v in got.items() if k not in expected]
    return all(_close(got[k], v, 1e-7) or abs(got[k] - v) < 1e-12 for k, v in expected.items()) and \
        all(isinstance(v, (int, float)) and abs(v) < 1e-12 for v in extra)


_REPLAY_MISTAKES = [
    ("recorded", "it compares the replay with the recording: the recorded collectives ran on a "
                 "loaded machine, slower than the fit says, so the difference mixes the load with the "
                 "world size. Replay the trace at its own size too (len(tr.ranks)) and compare the "
                 "two replays"),
    ("both", "it adds up every rank's ops: give rank 0's (tr.on(0) or e.rank == 0)"),
    ("none", "those are the times at the new size, not how much they grew: subtract the same "
             "ops' times replayed at the recorded size"),
]


@checker(needs_lab=False)
def replay_growth(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(tr, world_size, fit)``: per op, how many seconds more rank 0 spends in it when
    ``tr`` is replayed at ``world_size`` ranks than when replayed at its own size, same fit."""
    __tracebackhide__ = True
    _need(fn, "replay_growth")
    calls = replay_calls()
    answers = _answers(fn, "replay_growth", calls)
    scale = _keys.load("scale")               # after the student's code ran: never in a frame it sees
    for (tr, n, fit), got in zip(calls, answers):
        expected = scale.growth(tr, n, fit)
        if _same(got, expected):
            continue
        what = f"replay_growth(<a 2-rank trace>, {n}, alpha={fit['alpha']:.3g}, beta={fit['beta']:.3g})"
        if not isinstance(got, dict):
            raise Feedback(f"{what} returned {type(got).__name__}, not a dict.",
                           hint="return {op name: seconds grown} for every op of rank 0, e.g. "
                                "{'all_reduce': ..., 'wait': ...}.")
        missing = sorted(set(expected) - set(got))
        why = (f"ops of rank 0 missing from the dict: {', '.join(missing)}" if missing else
               next((text for base, text in _REPLAY_MISTAKES
                     if _same(got, scale.growth(tr, n, fit, base="replay" if base == "both" else base,
                                                ranks=(0, 1) if base == "both" else (0,)))),
                    "per op, how much longer rank 0's summed durations are in a replay at the new "
                    "size than in a replay at the trace's own size, with the same fit"))
        raise Feedback(f"{what} is wrong: got {got!r}.", hint=f"{why}.")
    passed(f"replay_growth measures what {len(calls)} traces' replays at 8 to 64 ranks made longer.")
