"""Checkers for notebook 13, pipelines built by hand: a forward pass, GPipe, 1F1B, the bubble.

    ddplab.check.gpipe(my_gpipe_step)       # against one process, its messages and order (``schedules``)

``_stages`` runs a student's schedule on the ranks, each rank a stage, its
messages followed; the references come from one process.
"""

from __future__ import annotations

from .schedules import *  # noqa: F401,F403
from .schedules import __all__ as _schedules

__all__ = sorted(_schedules)
