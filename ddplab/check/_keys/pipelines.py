"""Notebook 13's answer (``ddplab.check.nb13_build_pipelines``), loaded by its checks only.

``bubble(events)``: the share of p x (the step's end - its start) in which no rank's
compute ran, from a step's compute events (``tr.compute``).
"""

from __future__ import annotations


def bubble(events: list) -> float:
    """The share of p x (step's end - step's start) in which no rank's compute ran."""
    ranks = {e.rank for e in events}
    start, end = min(e.start for e in events), max(e.end for e in events)
    return 1 - sum(e.end - e.start for e in events) / (len(ranks) * (end - start))
