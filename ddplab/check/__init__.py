"""Checkers for the notebooks' exercises, one module per notebook.

A check cell calls one of these after the student's exercise cell:

    ddplab.check.ring_token()        # prints one fixed line, or raises AssertionError

Each prints ``Correct: ...`` when the answer is right and raises an
``AssertionError`` with, per rank, what was expected and what came when it
is wrong. They read the student's variables from the ranks (or run the
student's function there) and compute the expected answer independently,
usually with torch.distributed's own collective as the reference.
"""

from ._core import compare, passed, values_on_ranks
from . import allreduce, collectives, launchers, p2p, sharding, training
from .allreduce import *  # noqa: F401,F403
from .collectives import *  # noqa: F401,F403
from .launchers import *  # noqa: F401,F403
from .p2p import *  # noqa: F401,F403
from .sharding import *  # noqa: F401,F403
from .training import *  # noqa: F401,F403

__all__ = sorted(["compare", "passed", "values_on_ranks", *allreduce.__all__,
                  *collectives.__all__, *launchers.__all__, *p2p.__all__, *sharding.__all__,
                  *training.__all__])
