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

Teaching modules, the top-level modules notebooks may import (``from ddplab import train``),
in the kernel or on the ranks: ``algorithms``, ``attention``, ``bench``, ``checkpointing``, ``data``, ``env``,
``hints`` (``ddplab.hint``, ``ddplab.solution``), ``hosts``, ``launch``, ``memory``, ``moe``, ``pipeline``,
``plan`` (``ddplab.plan(...)``: memory and step time per strategy before the machines),
``progress``, ``quiet``, ``sharding``, ``show``, ``train``. What a notebook imports is
this list, the package itself and its checkers, ddplab.check: tools/check_layout.py reads
every notebook's import lines.

The packages: ``lab`` (the kernel side: a lab, its ranks, its calls), ``rank`` (code that runs
inside an engine), ``trace`` (the timeline), ``check`` (the notebooks' checkers), ``procs`` (the
one owner of child processes), ``course`` (release, grading, the CLI). The rest of the top level
is small shared infrastructure: ``errors``, ``limits``, ``text`` (``env``, which every part
uses, is a teaching module: notebook 03 imports it, and it says what torchrun tells each rank).
``tools/check_layout.py`` holds the top level to this list.
"""

from . import check, trace
from .errors import ConfigError, DdplabError, EngineDiedError, HangError, RankError
from .hints import hint, solution
from .lab import Lab, attach, current, start
from .lab.magics import load_ipython_extension
from .lab.scratch import scratch_folder
from .plan import plan  # the function; its steps stay importable: ``from ddplab.plan import Config``
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
    "plan",
    "scratch_folder",
    "show",
    "solution",
    "start",
    "trace",
]
__version__ = "0.1.0"
