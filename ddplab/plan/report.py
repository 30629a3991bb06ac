"""Step 5 of a plan: the table, the picture, and what fits.

``Plan`` holds one ``Row`` per strategy and world size; ``print(p)`` is the
table, ``p.picture()`` a matplotlib figure (memory per rank by kind, step
time by part), ``p.advice()`` says plainly what does not fit the device's
memory and what would: the fastest strategy that fits at each world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .precision import describe
from .step import Step

__all__ = ["Plan", "Row"]
_KINDS = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class Row:
    strategy: str
    world_size: int
    memory: dict[str, int] = field(default_factory=dict)   # per kind, bytes, rank 0
    peak: int = 0
    step: Step | None = None
    source: str = ""
    error: str | None = None          # why this case has no numbers
    tokens: int = 0                   # trained per step by all ranks: replicas x batch x seq
    model_states: int = 0             # the most parameters + gradients + optimizer state at once
    uncounted: list = field(default_factory=list)   # ops run that the flop counter had no formula for
    flops: int = 0                    # what the step time was made from: FLOPs (a micro-batch's
    parameters: int = 0               # under a pipeline) and the rank's stage's parameters

    @property
    def tokens_per_s(self) -> float:
        """What to compare strategies by at one world size: their steps train different
        global batches (tp and pp make fewer replicas, each as big)."""
        return self.tokens / self.step.total if self.step and self.step.total > 0 else 0.0

    @property
    def tokens_per_gpu(self) -> float:
        """Tokens trained per second per rank (what torchtitan's TPS/GPU reports)."""
        return self.tokens_per_s / self.world_size

    def fits(self, budget: float) -> bool:
        return self.error is None and self.peak <= budget


class Plan:
    """The plan for one model on one device and network, its rows in the order asked."""

    def __init__(self, model: Any, device: Any, network: Any, rows: list[Row]) -> None:
        self.model, self.device, self.network, self.rows = model, device, network, rows

    def row(self, strategy: str, world_size: int) -> Row:
        return next(r for r in self.rows if (r.strategy, r.world_size) == (strategy, world_size))

    def at_efficiency(self, efficiency: float) -> Plan:
        """The same plan with another efficiency: the step times made again from each row's
        FLOPs and parameters (no tracing). Calibrate it on one measured step, then read the
        others: ``p.at_efficiency(p.calibrated(row, measured_tokens_per_gpu))``."""
        from dataclasses import replace

        from . import inputs
        from .step import step
        from .strategies import parse

        device = replace(self.device, efficiency=inputs.efficiency(efficiency))
        rows = [r if r.error else replace(r, step=step(parse(r.strategy), self.model, r.world_size,
                                                       r.flops, r.parameters, device, self.network))
                for r in self.rows]
        return Plan(self.model, device, self.network, rows)

    def calibrated(self, row: Row, tokens_per_gpu: float) -> float:
        """The efficiency at which ``row`` trains ``tokens_per_gpu`` tokens per second per rank
        (bisection on the step time, which falls as the efficiency rises)."""
        low, high = 1e-4, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            got = self.at_efficiency(middle).row(row.strategy, row.world_size).tokens_per_gpu
            low, high = (middle, high) if got < tokens_per_gpu else (low, middle)
        return (low + high) / 2

    def table(self) -> str:
        gb = 1e9
        head = (f"{'strategy':<16}{'ranks':>6} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
                f"{'peak GB':>8} {'fits':>5} | {'compute':>8} {'comm':>8} {'exposed':>8} {'bubble':>8} "
                f"{'step s':>8} {'torch comm':>10} {'Mtok/s':>7}")
        m = self.model
        lines = [f"{m.name}: {m.parameters / 1e9:.3g}B parameters, {m.batch} x {m.seq} tokens per replica, "
                 f"checkpointing {m.checkpointing}; {self.device.name} ({self.device.memory / gb:g} GB, "
                 f"efficiency {self.device.efficiency:g}); {self.network.name}",
                 f"precision {describe(m.precision)}", head, "-" * len(head)]
        for r in self.rows:
            if r.error:
                lines.append(f"{r.strategy:<16}{r.world_size:>6}  cannot: {r.error}")
                continue
            k, s = r.memory, r.step
            lines.append(
                f"{r.strategy:<16}{r.world_size:>6} " + " ".join(f"{k[kind] / gb:>7.2f}" for kind in _KINDS)
                + f" {r.peak / gb:>8.2f} {'yes' if r.fits(self.device.memory) else 'NO':>5} | "
                + " ".join(f"{v:>8.3g}" for v in (s.compute, s.communication, s.exposed, s.bubble, s.total))
                + f" {s.torch_communication:>10.3g} {r.tokens_per_s / 1e6:>7.3g}")
        uncounted = sorted({op for r in self.rows for op in r.uncounted})
        lines += ["", "memory: GB per rank; params/grads/optim after the optimizer step, activations when "
                  "the forward ends, peak: the most held at once (torch's trackers; not the allocator's "
                  "reserve).",
                  "time: seconds per step; comm: all collectives (α-β), exposed: the part not hidden "
                  "behind compute; torch comm: the same collectives by DTensor's cost model (NVLink-class "
                  "constants of its own, whatever the network); Mtok/s: millions of tokens trained per "
                  "second by all ranks.",
                  "sources: " + "; ".join(sorted({f"{r.strategy}: {r.source}" for r in self.rows
                                                  if r.source and not r.error}))]
        if uncounted:
            lines.append("FLOPs not counted (no formula in torch's counter; memory-bound, lumped into the "
                         "efficiency): " + ", ".join(uncounted))
        return "\n".join(lines + ["", self.advice()])

    def __repr__(self) -> str:
        return self.table()

    def advice(self, budget: float | None = None) -> str:
        """What does not fit ``budget`` bytes per rank (default: the device's memory), and the
        fastest strategy that does, per size."""
        budget, out = (self.device.memory if budget is None else budget), []
        for n in dict.fromkeys(r.world_size for r in self.rows):
            rows = [r for r in self.rows if r.world_size == n and not r.error]
            fitting = sorted((r for r in rows if r.fits(budget)), key=lambda r: -r.tokens_per_s)
            misses = [r.strategy for r in rows if not r.fits(budget)]
            line = f"{n} ranks: "
            if misses:
                line += f"does not fit in {budget / 1e9:g} GB: {', '.join(misses)}. "
            if fitting:
                best = fitting[0]
                line += f"fastest that fits: {best.strategy} ({best.tokens_per_s / 1e6:.3g}M tokens/s, " \
                        f"{best.step.total:.3g} s/step, {best.peak / 1e9:.3g} GB)."
            else:
                smallest = min(rows, key=lambda r: r.peak, default=None)
                line += "nothing asked fits" + (
                    f"; the smallest is {smallest.strategy} at {smallest.peak / 1e9:.3g} GB: try fsdp, "
                    f"more ranks, pp or tp, a smaller batch, or activation checkpointing."
                    if smallest else ".")
            out.append(line)
        return "\n".join(out)

    def picture(self):
        """Two bar charts side by side: memory per rank by kind, step time by part."""
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows if not r.error]
        labels = [f"{r.strategy}\n{r.world_size}" for r in rows]
        figure, (left, right) = plt.subplots(1, 2, figsize=(max(8, len(rows) * 1.1), 3.6), dpi=72)
        bottom = [0.0] * len(rows)
        for kind in (*_KINDS, "other at peak"):
            values = [(r.memory[kind] if kind in r.memory else
                       max(0, r.peak - sum(r.memory[k] for k in _KINDS))) / 1e9 for r in rows]
            left.bar(labels, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values)]
        left.axhline(self.device.memory / 1e9, color="red", linestyle="--", label="device memory")
        left.set_ylabel("GB per rank")
        left.legend(fontsize=7)
        bottom = [0.0] * len(rows)
        for part in ("compute", "exposed", "bubble", "hidden"):
            values = [getattr(r.step, part) for r in rows]
            right.bar(labels, values, bottom=bottom, label=part + (" comm" if part in ("exposed", "hidden")
                                                                    else ""),
                      alpha=0.4 if part == "hidden" else 1.0)
            bottom = [b + v for b, v in zip(bottom, values)]
        right.set_ylabel("seconds per step")
        right.legend(fontsize=7)
        for axis in (left, right):
            axis.tick_params(axis="x", labelsize=7)
        figure.tight_layout()
        return figure
