"""Checkers for notebook 15, at scale: the planner's numbers by hand (``predictions``).

    ddplab.check.predict_step(my_predict_step)      # compute + a ring all_reduce, by α-β

``_inputs`` draws machines, plans, pipelines and traces other than the notebook's.
"""

from __future__ import annotations

from .predictions import *  # noqa: F401,F403
from .predictions import __all__ as _predictions

__all__ = sorted(_predictions)
