"""Checkers for notebook 12, DDP, ZeRO and FSDP built by hand.

    ddplab.check.overlap_hooks(overlap_hooks, wait_for_gradients)   # DDP's overlap and buckets (``ddp``)
    ddplab.check.zero1_adam(Zero1Adam)                              # ZeRO-1 and FSDP (``sharded``)

``_steps64`` holds what they share: a tiny float64 model, batches drawn per
check, one process as the reference, and the verdict that names a mistake.
"""

from __future__ import annotations

from .ddp import *  # noqa: F401,F403
from .ddp import __all__ as _ddp
from .sharded import *  # noqa: F401,F403
from .sharded import __all__ as _sharded

__all__ = sorted([*_ddp, *_sharded])
