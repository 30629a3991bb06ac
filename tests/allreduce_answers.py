"""Notebook 06's own answers, and one wrong one, that the tests of its checkers share.

``tests/test_check_allreduce_*.py`` give these to ``ddplab.check``'s all_reduce checkers. They
travel to the ranks by value, as a test module's functions do (tests/conftest.py), not by name.
"""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def notebook_answer(exercise: str):
    """The reference notebook's own answer to ``exercise``, as a student's cell defines it.

    Not ddplab.algorithms' function, nor a copy of it: the checks refuse those, by
    identity and by shape (``check._reference``), as a student's copy of them.
    """
    import nbformat

    from ddplab.hints import BEGIN, END, reference_dir

    notebook = nbformat.read(reference_dir() / "06_build_all_reduce.ipynb", as_version=4)
    source = next(c.source for c in notebook.cells if c.get("id") == f"exercise-{exercise}")
    source = "\n".join(line for line in source.splitlines() if line.strip() not in (BEGIN, END))
    space = {"dist": dist, "torch": torch, "__name__": "__main__"}
    exec(compile(source, f"<cell exercise-{exercise}>", "exec"), space)
    return next(value for name, value in space.items() if name.startswith("my_"))


RING = notebook_answer("ring")
NAIVE = notebook_answer("naive")
NAIVE_COLLECTIVES = notebook_answer("naive-collectives")
RECURSIVE_DOUBLING = notebook_answer("recursive-doubling")
TREE = notebook_answer("tree")


def naive_without_broadcast(tensor):
    """Reduce to rank 0 and stop: only rank 0 holds the sum."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        inbox = torch.empty_like(tensor)
        for src in range(1, p):
            dist.recv(inbox, src=src)
            tensor += inbox
    else:
        dist.send(tensor, dst=0)
    return tensor
