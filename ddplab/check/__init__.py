"""Checkers for the notebooks' exercises, one module per notebook.

A check cell calls one of these after the student's exercise cell:

    ddplab.check.ring_token()        # prints one fixed line, or raises AssertionError

Each prints ``Correct: ...`` when the answer is right and raises an
``AssertionError`` with, per rank, what was expected and what came when it
is wrong. They read the student's variables from the ranks (or run the
student's function there) and compute the expected answer independently,
usually with torch.distributed's own collective as the reference.

A checker is named after its exercise, which is often the student's own
function: ``ddplab.check.global_rank(global_rank)`` checks ``global_rank``.
Notebooks call checkers through ``ddplab.check.``, so the two never collide.
"""

from . import (
               _keys,  # noqa: F401  (a grading worker seals the answer keys when it imports ddplab.check)
               allreduce,
               at_scale,
               build_ddp,
               build_sharded,
               byhand,
               checkpoints,
               clipping,
               collectives,
               debugging,
               elastic,
               experts,
               launchers,
               long_sequences,
               multinode,
               p2p,
               pipelines,
               precision,
               resume,
               samplers,
               setup,
               sharding_model,
               timeline,
               training,
)
from ._core import compare as compare, passed as passed, values_on_ranks as values_on_ranks
from .allreduce import *  # noqa: F401,F403
from .at_scale import *  # noqa: F401,F403
from .build_ddp import *  # noqa: F401,F403
from .build_sharded import *  # noqa: F401,F403
from .byhand import *  # noqa: F401,F403
from .checkpoints import *  # noqa: F401,F403
from .clipping import *  # noqa: F401,F403
from .collectives import *  # noqa: F401,F403
from .debugging import *  # noqa: F401,F403
from .elastic import *  # noqa: F401,F403
from .experts import *  # noqa: F401,F403
from .launchers import *  # noqa: F401,F403
from .long_sequences import *  # noqa: F401,F403
from .multinode import *  # noqa: F401,F403
from .p2p import *  # noqa: F401,F403
from .pipelines import *  # noqa: F401,F403
from .precision import *  # noqa: F401,F403
from .resume import *  # noqa: F401,F403
from .samplers import *  # noqa: F401,F403
from .setup import *  # noqa: F401,F403
from .sharding_model import *  # noqa: F401,F403
from .timeline import *  # noqa: F401,F403
from .training import *  # noqa: F401,F403

__all__ = sorted(["compare", "passed", "values_on_ranks", *allreduce.__all__, *at_scale.__all__,
                  *build_ddp.__all__,
                  *build_sharded.__all__, *byhand.__all__,
                  *checkpoints.__all__, *clipping.__all__, *collectives.__all__, *debugging.__all__,
                  *elastic.__all__, *experts.__all__, *launchers.__all__, *long_sequences.__all__,
                  *multinode.__all__, *p2p.__all__, *pipelines.__all__, *precision.__all__, *resume.__all__,
                  *setup.__all__,
                  *samplers.__all__, *sharding_model.__all__,
                  *timeline.__all__, *training.__all__])
