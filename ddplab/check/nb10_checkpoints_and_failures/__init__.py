"""Checkers for notebook 10, checkpoints and failures.

    ddplab.check.save_sharded()         # torch.distributed.checkpoint of FSDP2, and loading it (``sharded``)
    ddplab.check.train_state()          # a Stateful that resumes mid-epoch (``resume``)
    ddplab.check.torchrun_resume()      # a job killed and restarted by torchrun (``elastic``)

The references these compare with (torch's own save and load, ``sharded``'s
``reference_save`` and ``reference_load``) the notebook imports from here, for
its resumable run; they are not checkers, so not in ``__all__``.
"""

from __future__ import annotations

from .elastic import *  # noqa: F401,F403
from .elastic import __all__ as _elastic
from .resume import *  # noqa: F401,F403
from .resume import __all__ as _resume
from .sharded import *  # noqa: F401,F403
from .sharded import __all__ as _sharded, reference_load as reference_load, reference_save as reference_save

__all__ = sorted([*_sharded, *_resume, *_elastic])
