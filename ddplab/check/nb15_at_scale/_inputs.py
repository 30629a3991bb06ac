"""The inputs the notebook-15 checks draw (``predictions``): machines, plans, pipelines
and traces other than the notebook's, so that a number copied from the notebook fails. The
traces' collectives are timed by the answer key's ring (``ddplab.check._keys``), loaded when
``replay_calls`` draws them."""

from __future__ import annotations

from typing import Any, Callable

from .. import _keys

__all__ = ["BUBBLES", "FITS", "STEPS", "fits_cases", "replay_calls"]


#: (flops, flop_rate, grad_bytes, world_size, alpha, beta): a CPU lab, an H100 node, 64 and 1024 ranks.
STEPS = [(6.2e9, 1.7e10, 8.4e6, 2, 9e-5, 5e-10), (4.1e13, 4e14, 2.0e9, 8, 3e-6, 2.8e-12),
         (4.1e13, 4e14, 2.0e9, 64, 8e-6, 2.5e-11), (1.2e12, 3e13, 5e8, 1024, 8e-6, 2.5e-11)]


def _row(name: str, peak: float, state: float, activations: float, compute: float, exposed: float,
         tokens: int, error: str | None = None) -> Any:
    from ddplab.plan import Row, Step

    if error:
        return Row(name, 64, error=error)
    third = state / 3
    memory = {"parameters": int(third), "gradients": int(third), "optimizer": int(third),
              "activations": int(activations)}
    return Row(name, 64, memory, int(peak), Step(compute=compute, exposed=exposed),
               tokens=tokens)


def fits_cases() -> list[tuple[list, float]]:
    """(rows at 64 ranks, budget in bytes): the fastest never fits, a row's memory without its
    temporaries fits where its peak does not, the shortest step trains fewer tokens."""
    GB, tok = 1e9, 64 * 8 * 1024
    a = [_row("ddp", 31 * GB, 16 * GB, 6 * GB, 0.11, 0.03, tok),
         _row("zero1", 23 * GB, 13 * GB, 6 * GB, 0.11, 0.07, tok),
         _row("fsdp", 17 * GB, 1 * GB, 6 * GB, 0.11, 0.09, tok),
         _row("tp8+fsdp", 7 * GB, 0.2 * GB, 2.7 * GB, 0.014, 0.02, tok // 8),
         _row("pp4+fsdp", 0, 0, 0, 0, 0, 0, error="16 layers do not split into 3 equal stages")]
    b = [_row("ddp", 15 * GB, 8 * GB, 3 * GB, 0.05, 0.01, tok),
         _row("fsdp", 9.5 * GB, 0.5 * GB, 3 * GB, 0.05, 0.04, tok),
         _row("tp8+fsdp", 3 * GB, 0.1 * GB, 1.2 * GB, 0.006, 0.03, tok // 8),
         _row("pp4+fsdp", 4 * GB, 0.2 * GB, 1 * GB, 0.012, 0.015, tok // 4)]
    c = [_row("ddp", 31 * GB, 16 * GB, 6 * GB, 0.11, 0.03, tok),
         _row("fsdp", 17 * GB, 1 * GB, 6 * GB, 0.11, 0.09, tok),
         _row("tp8+pp4+fsdp", 0, 0, 0, 0, 0, 0, error="heads do not split over tp=8")]
    return [(a, 20 * GB), (a, 12 * GB), (b, 10 * GB), (b, 3.5 * GB), (c, 16 * GB)]


#: (stages, sequences per replica, target): m must divide the batch; 3/30 is 0.1 exactly.
BUBBLES = [(4, 360, 0.10), (4, 540, 0.10), (16, 720, 0.15), (8, 8, 0.10), (1, 8, 0.10), (2, 64, 0.05)]


def _trace(slow: float, small: int, big: int, ring: Callable[..., float]) -> Any:
    """Two ranks, three rounds of 20 ms of work, a blocking all_reduce of ``big`` bytes and an
    async one of ``small`` bytes waited on later, each ``slow`` times its α-β time at 2 ranks
    under the first fit (a loaded machine records slower collectives than the fit says);
    ``ring``: the key's α-β time of an all_reduce."""
    from ddplab.trace import Trace
    from ddplab.trace.events import event

    alpha, beta = FITS[0]["alpha"], FITS[0]["beta"]
    rows, compute = [], []
    for rank in (0, 1):
        t = 0.0
        for _ in range(3):
            compute.append(dict(rank=rank, op="work", kind="compute", start=t, end=t + 0.02))
            t += 0.02
            took = slow * ring(2, big, alpha, beta)
            rows.append(dict(rank=rank, op="all_reduce", kind="collective", start=t, end=t + took,
                             nbytes=big))
            t += took
            done = t + slow * ring(2, small, alpha, beta)
            rows.append(dict(rank=rank, op="all_reduce", kind="collective", start=t, end=t + 1e-5,
                             nbytes=small, blocking=False, done=done))
            rows.append(dict(rank=rank, op="wait", kind="wait", start=t + 2e-5, end=done + 1e-5,
                             of=len(rows) - 1))
            t = done + 1e-5
    events = [event(i, dict(row, index=i)) for i, row in enumerate(rows)]
    return Trace.made(events, [event(-1, c) for c in compute], [0, 1], "made by ddplab.check")


FITS = [{"alpha": 9e-5, "beta": 5e-10}, {"alpha": 8e-6, "beta": 2.5e-11}, {"alpha": 4e-4, "beta": 2e-9}]


def replay_calls() -> list[tuple[Any, int, dict]]:
    """(trace, world size, fit): recorded 1.5 to 3 times slower than the fit says."""
    ring = _keys.load("scale").ring
    return [(_trace(2.5, 4096, 4 << 20, ring), 8, FITS[0]), (_trace(1.5, 1024, 16 << 20, ring), 64, FITS[1]),
            (_trace(3.0, 64, 1 << 20, ring), 16, FITS[2])]
