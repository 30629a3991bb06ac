"""Notebook 15's answers (``ddplab.check.nb15_at_scale``), loaded by its checks only.

- ``ring`` and ``step``: a ring all_reduce's time by α-β, and a data-parallel step's
  (compute, then the all_reduce, nothing overlapped);
- ``fits_right`` (``fits_by`` a row's peak): the fastest strategy that fits a budget;
- ``smallest`` with ``share``: the fewest micro-batches that divide the batch and
  bring the 1F1B bubble's share of the step under a target;
- ``growth`` (``per_op``): per op, how much longer rank 0 is in a replay at N ranks
  than in one at the trace's own size.

The checks' named mistakes call ``fits_by``, ``smallest`` and ``growth`` with
other arguments.
"""

from __future__ import annotations

from typing import Any, Callable


def ring(n: int, nbytes: float, alpha: float, beta: float) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def step(flops: float, rate: float, nbytes: float, n: int, alpha: float, beta: float) -> float:
    return flops / rate + ring(n, nbytes, alpha, beta)


def fits_by(rows: list, budget: float, size: Callable[[Any], float]) -> str | None:
    fitting = [r for r in rows if r.error is None and size(r) <= budget]
    return max(fitting, key=lambda r: r.tokens_per_s).strategy if fitting else None


def fits_right(rows: list, budget: float) -> str | None:
    return fits_by(rows, budget, lambda r: r.peak)


def share(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def smallest(p: int, batch: int, target: float, bubble: Callable, under: bool = True,
             divides: bool = True) -> int | None:
    for m in range(1, batch + 1):
        part = bubble(p, m)
        if (part < target if under else part <= target) and (not divides or batch % m == 0):
            return m
    return None


def per_op(tr: Any, ranks: tuple = (0,)) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in tr.events:
        if e.rank in ranks:
            out[e.op] = out.get(e.op, 0.0) + e.duration
    return out


def growth(tr: Any, n: int, fit: dict, base: str = "replay", ranks: tuple = (0,)) -> dict[str, float]:
    big = per_op(tr.replay(world_size=n, **fit), ranks)
    small = per_op(tr if base == "recorded" else tr.replay(world_size=len(tr.ranks), **fit), ranks)
    if base == "none":
        small = dict.fromkeys(big, 0.0)
    return {op: big[op] - small.get(op, 0.0) for op in big}
