"""Checkers for notebook 11, memory and precision.

    ddplab.check.mixed_step()       # bf16 autocast, accumulation, checkpointing, hooks (``precision``)
    ddplab.check.clip_sharded()     # a gradient norm clipped across shards (``clipping``)
"""

from __future__ import annotations

from .clipping import *  # noqa: F401,F403
from .clipping import __all__ as _clipping
from .precision_checks import *  # noqa: F401,F403
from .precision_checks import __all__ as _precision

__all__ = sorted([*_precision, *_clipping])
