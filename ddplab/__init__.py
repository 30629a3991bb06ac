"""ddplab: learn and teach torch.distributed in a notebook.

    lab = ddplab.start(world_size=2)     # one ipyparallel engine per rank, one process group
    lab.run(lambda: dist.get_rank())     # [0, 1]

    %%rank 0                             # a cell on rank 0 only, like one of two Python prompts
    dist.send(torch.ones(3), dst=1)

    ddplab.show("t")                     # the tensor t of every rank, as a rank x element grid
    ddplab.check.ring_token()            # a notebook exercise's checker
    ddplab.hint("ring-token")            # stuck? a hint, then ddplab.solution("ring-token")

    with lab.trace() as tr:              # who waited for whom: a timeline of every rank's
        lab.run(step)                    # torch.distributed calls (or %%ranks --trace)

    ddplab.breakpoint(rank=1)            # in code on the ranks: pdb on rank 1, its prompt
                                         # (Pdb rank 1) in the notebook (or %%rank 1 --pdb);
    %ddplab_debug                        # after a RankError: post-mortem on the rank that raised

    folder = ddplab.scratch_folder("nb10")   # checkpoints every rank sees; gone with the last
                                         # lab.stop() or the kernel, however it ends

See ``ddplab.lab`` for the lab's lifecycle and its failure modes.
"""

from . import check, trace
from .course.notebooks import hint, solution
from .errors import ConfigError, DdplabError, EngineDiedError, HangError, RankError
from .lab import Lab, attach, current, start
from .lab.magics import load_ipython_extension
from .lab.scratch import scratch_folder
from .rank.debugger import breakpoint
from .show import Picture, show
from .trace import Trace

__all__ = [
    "ConfigError",
    "DdplabError",
    "EngineDiedError",
    "HangError",
    "Lab",
    "Picture",
    "RankError",
    "Trace",
    "attach",
    "breakpoint",
    "check",
    "current",
    "hint",
    "load_ipython_extension",
    "scratch_folder",
    "show",
    "solution",
    "start",
    "trace",
]
__version__ = "0.1.0"
