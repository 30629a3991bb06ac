"""Checkers for notebook 14, long sequences and experts.

    ddplab.check.ring_attention(my_ring_attention)   # the lse merge, ring attention, Ulysses (``attention``)
    ddplab.check.moe_layer(my_moe_layer)             # expert parallelism and its balance loss (``experts``)

``_ring`` runs a student's function on the ranks and watches how it works
(its messages, its products, the collectives it may not call).
"""

from __future__ import annotations

from .attention import *  # noqa: F401,F403
from .attention import __all__ as _attention
from .experts import *  # noqa: F401,F403
from .experts import __all__ as _experts

__all__ = sorted([*_attention, *_experts])
