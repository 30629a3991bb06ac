"""Live training progress, one bar per rank, while a ddplab cell runs.

A ``%%ranks`` cell or ``lab.run`` blocks the kernel until every rank is done,
and a widget made on a rank never reaches the browser. So the two halves live
in different processes:

- On the rank, the training loop calls ``report(step, total, loss=...)``. On a
  ddplab rank that publishes the numbers through ipyparallel's data channel
  (``publish_data``), at most ten times a second. Anywhere else (torchrun,
  ``torch.multiprocessing.spawn``, plain Python) it does nothing, so one
  training function runs unchanged under every launcher.
- In the kernel, while the lab waits for the ranks, it hands each rank's latest
  numbers to a ``ProgressBars`` (``ddplab.lab.bars``): in Jupyter one
  ``ipywidgets`` bar per rank, updated live; elsewhere a text line per rank at
  every quarter of the way.

This module is the rank's half: what a training loop calls.
"""

from __future__ import annotations

import math
import time
from typing import Any

#: The key under which ``report`` publishes, in each AsyncResult's ``.data``.
KEY = "ddplab_progress"
#: Seconds between two published updates of one rank (the last step always goes out).
MIN_INTERVAL = 0.1
_last_sent = {"time": -math.inf}


def _publisher():
    """ipyparallel's ``publish_data`` when running on a ddplab rank, else None."""
    from .rank.live import publisher
    return publisher()


def report(step: int, total: int, **metrics: Any) -> bool:
    """Tell the notebook this rank has done ``step`` of ``total`` steps.

    ``metrics`` (numbers, or one-element tensors such as a loss) are shown
    beside the bar, e.g. ``report(i, n, epoch=2, loss=loss)``. A tensor is
    read (``.item()``, which waits for the GPU) only when an update is
    actually sent. Returns whether one was sent; outside a ddplab rank, never.
    """
    now = time.monotonic()
    if step < total and now - _last_sent["time"] < MIN_INTERVAL:
        return False
    publish = _publisher()
    if publish is None:
        return False
    _last_sent["time"] = now
    numbers = {name: float(value.detach().item() if hasattr(value, "detach") else value)
               for name, value in metrics.items()}
    publish({KEY: {"step": int(step), "total": int(total), "metrics": numbers}})
    return True
