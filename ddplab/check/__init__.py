"""Checkers for the notebooks' exercises, one module (or package) per notebook.

A check cell calls one of these after the student's exercise cell:

    ddplab.check.ring_token()        # prints one fixed line, or raises Feedback

Each prints ``Correct: ...`` when the answer is right and raises a
``Feedback`` (an ``AssertionError``) when it is wrong: a headline that names
the mistake, what each rank should have held and what it held where that
does not give the answer away, and a hint. They read the student's variables
from the ranks (or run the student's function there) and compute the
expected answer independently, usually with torch.distributed's own
collective as the reference.

A checker is named after its exercise, which is often the student's own
function: ``ddplab.check.global_rank(global_rank)`` checks ``global_rank``.
Notebooks call checkers through ``ddplab.check.``, so the two never collide.

The layout (``tools/check_layout.py`` holds it): notebook ``NN_topic.ipynb``'s
checkers are in ``nbNN_topic`` (a module, or a package when they need more
than one), its private helpers inside it; what several notebooks share is in
the underscore modules here: ``_core`` (the ``@checker`` decorator, running
the student's code, ``compare``, ``passed``), ``_feedback`` (the one kind of
feedback), ``_student`` (the student's exception and a deadlock, as feedback),
``_forbid`` (refused collectives and libraries), ``_peers``, ``_timeline``.
"""

from __future__ import annotations

import importlib

from . import _keys  # noqa: F401  (a grading worker seals the answer keys when it imports ddplab.check)
from ._core import compare as compare, passed as passed, values_on_ranks as values_on_ranks
from ._feedback import Feedback as Feedback

#: Every notebook's checkers, in course order: adding a notebook's is this one line.
NOTEBOOKS = (
    "nb00_setup",
    "nb01_point_to_point",
    "nb02_collectives",
    "nb02b_collectives_gather_scatter",
    "nb03_init_methods_and_launchers",
    "nb04_sampler_sharding",
    "nb05_ddp_training",
    "nb06_build_all_reduce",
    "nb07_multi_node",
    "nb08_sharding_the_model",
    "nb09_debugging",
    "nb10_checkpoints_and_failures",
    "nb11_memory_and_precision",
    "nb12_build_ddp_zero_fsdp",
    "nb13_build_pipelines",
    "nb14_long_sequences_and_experts",
    "nb15_at_scale",
)

__all__ = ["Feedback", "compare", "passed", "values_on_ranks"]
for _notebook in NOTEBOOKS:
    _module = importlib.import_module(f"{__name__}.{_notebook}")
    if set(_module.__all__) & set(__all__):        # one name, one checker: never shadowed
        raise ImportError(f"ddplab.check.{_notebook} exports {set(_module.__all__) & set(__all__)}, "
                          f"which an earlier module exports too")
    globals().update({name: getattr(_module, name) for name in _module.__all__})
    __all__ += _module.__all__
__all__ = sorted(__all__)
del _notebook, _module
