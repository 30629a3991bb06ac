"""Pipeline parallelism by hand (notebook 13): a small model cut into stages, and its micro-batches.

    whole = pipeline.model(stages=4)                  # float64: one Linear(8, 8) + Tanh per stage
    stage = pipeline.Stage(whole, rank, work=0.01)    # this rank's part; forward sleeps 10 ms, backward 20 ms
    inputs, targets = pipeline.micro_batches(4)       # 4 micro-batches of 2 rows: the batch cut in four
    loss = pipeline.loss_fn(stage(inputs[0]), targets[0])

A ``Stage`` notes every forward and backward of a micro-batch in ``stage.log``
(``[("F", 0), ("F", 1), ("B", 0), ...]``), from which ``live_activations``
counts how many micro-batches' activations the rank held at once. Its forward
is a ``ddplab.trace.region`` named ``F0``, ``F1``, ... on the timeline; a
backward shows there as the ``backward`` call that ran it. ``work`` stands in for a
big layer's compute (a tiny Linear takes microseconds, less than a message), so
that the timeline shows the schedule rather than Python's overheads.

For pipelines bigger than the lab, ``schedule_order("1F1B", p, m)`` lists each
rank's forwards and backwards, and ``simulate`` plays such an order with
forward and backward times: when each op would start and end, waiting for the
previous stage's forward and the next stage's backward of the same micro-batch.
``bubble(timeline)`` is the idle share of the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .rank.trace import region

__all__ = ["WIDTH", "Stage", "bubble", "chart", "live_activations", "loss_fn", "micro_batches",
           "model", "schedule_order", "simulate"]

#: Features in and out of every stage: every activation sent between stages is (rows, WIDTH).
WIDTH = 8


def model(stages: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """The whole model: ``stages`` blocks of Linear(8, 8) + Tanh, the same for a seed everywhere."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                               for _ in range(stages)]).to(dtype)


def micro_batches(m: int, rows: int = 2, seed: int = 1,
                  dtype: torch.dtype = torch.float64) -> tuple[list[Any], list[Any]]:
    """A batch of ``m * rows`` inputs and targets, cut into ``m`` micro-batches of ``rows`` rows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m * rows, WIDTH, generator=generator, dtype=dtype)
    y = torch.randn(m * rows, WIDTH, generator=generator, dtype=dtype)
    return list(x.split(rows)), list(y.split(rows))


def loss_fn(output: Any, target: Any) -> Any:
    """The loss of one micro-batch (or of the whole batch): mean squared error."""
    return torch.nn.functional.mse_loss(output, target)


class _Work(torch.autograd.Function):
    """The identity, whose backward sleeps: the backward of a stage standing in for a big one."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Stage(nn.Module):
    """Rank ``index``'s block of ``whole`` (a copy), which notes what it does in ``log``.

    ``work`` seconds of sleep in each forward, twice that in each backward: a
    backward costs about two forwards in a real network.
    """

    def __init__(self, whole: nn.Sequential, index: int, work: float = 0.0) -> None:
        super().__init__()
        import copy

        self.block = copy.deepcopy(whole[index])
        self.index, self.work = index, work
        self.log: list[tuple[str, int]] = []

    def forward(self, x: Any) -> Any:
        micro = sum(1 for kind, _ in self.log if kind == "F")
        with region(f"F{micro}"):
            if self.work:
                time.sleep(self.work)
            out = self.block(x)
        if self.work and out.requires_grad:
            out = _Work.apply(out, 2 * self.work)
        if out.requires_grad:
            out.register_hook(lambda grad: self.log.append(("B", micro)))
        self.log.append(("F", micro))
        return out


def live_activations(log: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage held at once: forwards not yet backwarded."""
    live = peak = 0
    for kind, _ in log:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def schedule_order(name: str, p: int, m: int) -> dict[int, list[tuple[str, int]]]:
    """Each rank's ("F", i) and ("B", i) in the order the schedule ``name`` ("GPipe", "1F1B") runs them.

    GPipe: all m forwards, then all m backwards. 1F1B: rank r first runs
    min(p - 1 - r, m) warm-up forwards, then one forward and one backward in turn,
    then the backwards left.
    """
    key = name.lower()
    if key not in ("gpipe", "1f1b"):
        raise ValueError(f"ddplab: schedule_order knows 'GPipe' and '1F1B', not {name!r}.")
    order = {}
    for rank in range(p):
        if key == "gpipe":
            order[rank] = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            continue
        warmup = min(p - 1 - rank, m)
        ops = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        order[rank] = ops + [("B", i) for i in range(m - warmup, m)]
    return order


def simulate(order: Any, p: int, m: int, forward: float = 1.0,
             backward: float = 2.0) -> dict[int, list[tuple[str, int, float, float]]]:
    """When each op of ``order`` (a schedule name or ``schedule_order``'s lists) starts and ends.

    A forward of micro-batch i on stage r waits for stage r - 1's forward of i; a
    backward waits for stage r + 1's backward of i (on the last stage, its own
    forward). Messages take no time. Raises ``RuntimeError`` naming the stuck
    ranks if the order can never finish (a deadlock).
    """
    if isinstance(order, str):
        order = schedule_order(order, p, m)
    done: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * p, [0] * p
    out: dict[int, list] = {rank: [] for rank in range(p)}
    while any(nxt[r] < len(order[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(order[r]):
                kind, i = order[r][nxt[r]]
                need = (("F", r - 1, i) if r > 0 else None) if kind == "F" else \
                    (("B", r + 1, i) if r < p - 1 else ("F", r, i))
                if need is not None and need not in done:
                    break
                start = max(free[r], done.get(need, 0.0))
                end = start + (forward if kind == "F" else backward)
                done[(kind, r, i)], free[r] = end, end
                out[r].append((kind, i, start, end))
                nxt[r] += 1
                moved = True
        if not moved:
            stuck = [f"rank {r} at {''.join(map(str, order[r][nxt[r]]))}" for r in range(p)
                     if nxt[r] < len(order[r])]
            raise RuntimeError(f"ddplab: this order deadlocks: {', '.join(stuck)} wait forever.")
    return out


def bubble(timeline: dict[int, list[tuple[str, int, float, float]]]) -> float:
    """The idle share of a simulated step: 1 - work / (p x the step's length)."""
    ops = [op for ops in timeline.values() for op in ops]
    length = max(op[3] for op in ops) - min(op[2] for op in ops)
    return 1 - sum(op[3] - op[2] for op in ops) / (len(timeline) * length)


def chart(timeline: dict[int, list[tuple[str, int, float, float]]], unit: float = 1.0) -> str:
    """A simulated step as text: a row per rank, two characters per ``unit`` of time, ``··`` idle."""
    end = max(op[3] for ops in timeline.values() for op in ops)
    rows = []
    for rank, ops in sorted(timeline.items()):
        cells = ["··"] * round(end / unit)
        for kind, i, start, stop in ops:
            for t in range(round(start / unit), round(stop / unit)):
                cells[t] = f"{kind}{i}"
        rows.append(f"rank {rank} |{''.join(cells)}|")
    return "\n".join(rows)
