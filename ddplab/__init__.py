"""ddplab: learn and teach torch.distributed in a notebook.

    lab = ddplab.start(world_size=2)     # one ipyparallel engine per rank, one process group
    lab.run(lambda: dist.get_rank())     # [0, 1]

    %%rank 0                             # a cell on rank 0 only, like one of two Python prompts
    dist.send(torch.ones(3), dst=1)

    ddplab.show("t")                     # the tensor t of every rank, as a rank x element grid
    ddplab.check.ring_token()            # a notebook exercise's checker

See ``ddplab.cluster`` for the lab's lifecycle and its failure modes.
"""

from . import check
from .cluster import Lab, current, start
from .multihost import attach
from .errors import ConfigError, DdplabError, EngineDiedError, HangError, RankError
from .magics import load_ipython_extension
from .show import Picture, show

__all__ = [
    "ConfigError",
    "DdplabError",
    "EngineDiedError",
    "HangError",
    "Lab",
    "Picture",
    "RankError",
    "attach",
    "check",
    "current",
    "load_ipython_extension",
    "show",
    "start",
]
__version__ = "0.1.0"
