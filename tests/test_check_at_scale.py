"""The notebook-15 checkers: a step by hand, what fits, the bubble, a replay's growth.

Each is a plain function checked on inputs the check draws (no lab: ``answers_of`` calls it here
when none runs). For each: the reference passes, the stub fails, and plausible wrong answers fail
with a message naming the mistake and never the expected answer.
"""

from __future__ import annotations

import math

import pytest
from conftest import fails

from ddplab.check.nb15_at_scale import predictions as check


def stub(*args):
    raise NotImplementedError()


# ------------------------------------------------------- the reference solutions
def predict_step(flops, flop_rate, grad_bytes, world_size, alpha, beta):
    n = world_size
    return flops / flop_rate + 2 * (n - 1) * alpha + 2 * (n - 1) / n * grad_bytes * beta


def fits_budget(rows, budget):
    fitting = [r for r in rows if r.error is None and r.peak <= budget]
    return max(fitting, key=lambda r: r.tokens_per_s).strategy if fitting else None


def bubble_microbatches(p, batch, target):
    for m in range(1, batch + 1):
        if batch % m == 0 and (p - 1) / (m + p - 1) < target:
            return m
    return None


def bubble_closed_form(p, batch, target):
    """Another right method: m > (p-1)(1-t)/t, then the first divisor of the batch from there."""
    low = math.floor((p - 1) * (1 - target) / target) + 1 if p > 1 else 1
    return next((m for m in range(max(1, low), batch + 1) if batch % m == 0
                 and (p - 1) / (m + p - 1) < target), None)


def replay_growth(tr, world_size, fit):
    def per_op(trace):
        out = {}
        for e in trace.on(0):
            out[e.op] = out.get(e.op, 0.0) + e.duration
        return out
    big = per_op(tr.replay(world_size=world_size, **fit))
    small = per_op(tr.replay(world_size=len(tr.ranks), **fit))
    return {op: big[op] - small.get(op, 0.0) for op in big}


@pytest.mark.parametrize("name, right", [("predict_step", predict_step), ("fits_budget", fits_budget),
                                         ("bubble_microbatches", bubble_microbatches),
                                         ("bubble_microbatches", bubble_closed_form),
                                         ("replay_growth", replay_growth)])
def test_the_reference_passes_and_the_stub_fails(name, right, capsys):
    getattr(check, name)(right)
    assert capsys.readouterr().out.startswith(f"Correct: {name}")
    fails(lambda: getattr(check, name)(stub), "NotImplementedError")
    fails(lambda: getattr(check, name)(42), f"ddplab.check.{name}(my_{name})")


# ------------------------------------------------------- a step by hand
@pytest.mark.parametrize("wrong, named", [
    (lambda f, r, s, n, a, b: f / r + 2 * (n - 1) * a + 2 * s * b, "(N-1)/N factor"),
    (lambda f, r, s, n, a, b: f / r + (n - 1) * a + (n - 1) / n * s * b, "the 2 is missing"),
    (lambda f, r, s, n, a, b: 2 * (n - 1) * a + 2 * (n - 1) / n * s * b, "compute is missing"),
    (lambda f, r, s, n, a, b: f / r + 2 * (n - 1) / n * s * b, "latency is missing"),
    (lambda f, r, s, n, a, b: max(f / r, 2 * (n - 1) * a + 2 * (n - 1) / n * s * b), "overlap"),
    (lambda f, r, s, n, a, b: 0.1465, "nothing hidden"),    # a number copied from the notebook
])
def test_predict_step_names_the_mistake(wrong, named):
    message = fails(lambda: check.predict_step(wrong), named)
    assert "expected" not in message


def predict_by_the_planner(flops, flop_rate, grad_bytes, world_size, alpha, beta):
    """The bypass: the planner's own α-β cost instead of the formula."""
    from ddplab.plan import Network

    network = Network.from_bench({"alpha": alpha, "beta": beta})
    return flops / flop_rate + network.seconds("all_reduce", grad_bytes, world_size)


def test_predict_step_refuses_the_planners_cost():
    fails(lambda: check.predict_step(predict_by_the_planner), "may not call the planner's Network.seconds")
    from ddplab.plan import Network
    assert Network.from_bench({"alpha": 1.0, "beta": 0.0}).seconds("all_reduce", 0, 2) == 2.0   # put back


# ------------------------------------------------------- what fits
def fastest_anyway(rows, budget):
    return max((r for r in rows if not r.error), key=lambda r: r.tokens_per_s).strategy


def by_state(rows, budget):
    """Fits by parameters + gradients + optimizer + activations, not by the peak."""
    def size(r):
        return sum(r.memory.values())
    fitting = [r for r in rows if r.error is None and size(r) <= budget]
    return max(fitting, key=lambda r: r.tokens_per_s).strategy if fitting else None


def shortest_step(rows, budget):
    fitting = [r for r in rows if r.error is None and r.peak <= budget]
    return min(fitting, key=lambda r: r.step.total).strategy if fitting else None


def smallest(rows, budget):
    return min((r for r in rows if not r.error), key=lambda r: r.peak).strategy


def errors_fit(rows, budget):
    return max((r for r in rows if r.peak <= budget), key=lambda r: r.tokens_per_s).strategy


def always_fsdp(rows, budget):
    return "fsdp"


@pytest.mark.parametrize("wrong, named", [
    (fastest_anyway, "fastest strategy, and it does not fit"), (by_state, "not its peak"),
    (shortest_step, "tokens_per_s"), (smallest, "smallest, not the fastest"),
    (errors_fit, "a row with an error fits nothing"), (always_fsdp, "Hint")])
def test_fits_budget_names_the_mistake(wrong, named):
    fails(lambda: check.fits_budget(wrong), named)


# ------------------------------------------------------- the bubble
def over_m(p, batch, t):
    return next((m for m in range(1, batch + 1) if batch % m == 0 and (p - 1) / m < t), None)


def at_most(p, batch, t):
    return next((m for m in range(1, batch + 1) if batch % m == 0 and (p - 1) / (m + p - 1) <= t), None)


def any_m(p, batch, t):
    return next(m for m in range(1, 10**6) if (p - 1) / (m + p - 1) < t)


def never_none(p, batch, t):
    return bubble_microbatches(p, batch, t) or batch


def copied(p, batch, t):
    return 30


@pytest.mark.parametrize("wrong, named", [
    (over_m, "the bubble over the *compute*, (p-1)/m"), (at_most, "at most"),
    (any_m, "divide the batch"), (never_none, "return None"), (copied, "Hint")])
def test_bubble_microbatches_names_the_mistake(wrong, named):
    message = fails(lambda: check.bubble_microbatches(wrong), named)
    assert "expected" not in message
    assert "(m+p-1)" not in message and "batch % m" not in message   # never the answer's formula


# ------------------------------------------------------- a replay
def _per_op(events):
    out = {}
    for e in events:
        out[e.op] = out.get(e.op, 0.0) + e.duration
    return out


def against_recording(tr, n, fit):
    big, recorded = _per_op(tr.replay(world_size=n, **fit).on(0)), _per_op(tr.on(0))
    return {op: big[op] - recorded[op] for op in big}


def both_ranks(tr, n, fit):
    return {op: 2 * v for op, v in replay_growth(tr, n, fit).items()}


def totals(tr, n, fit):
    return _per_op(tr.replay(world_size=n, **fit).on(0))


def a_name(tr, n, fit):
    return "all_reduce"


def only_all_reduce(tr, n, fit):
    return {"all_reduce": replay_growth(tr, n, fit)["all_reduce"]}


@pytest.mark.parametrize("wrong, named", [
    (against_recording, "compares the replay with the recording"), (both_ranks, "every rank"),
    (totals, "not how much they grew"), (a_name, "not a dict"),
    (only_all_reduce, "missing from the dict: wait")])
def test_replay_growth_names_the_mistake(wrong, named):
    fails(lambda: check.replay_growth(wrong), named)
