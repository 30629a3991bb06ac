"""The course notebooks that ship with ddplab: copies for students and for instructors.

An installed ddplab (``pip install ddplab``) carries the reference notebooks
in ``ddplab/course/notebooks/`` (copied from the repository's ``notebooks/``
when the wheel is built); a checkout reads ``notebooks/`` itself.

    ddplab notebooks course/               # the student versions, solutions stubbed
    ddplab notebooks course/ --reference   # the reference versions, solutions in

A copy never overwrites a notebook that is already there: that file is a
student's work. So ``make lab`` runs it on every start to fill ``workspace/``
with the notebooks that are new, keeping the rest.

Where the reference notebooks are (``reference_dir``), and the hints and
solutions a student asks for from a cell, live in ``ddplab.hints``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# CourseError lives with every other exception; it stays importable from here too.
from ddplab.errors import CourseError

from ..hints import reference_dir, reference_notebooks

# nbformat and .release are imported where used: ``import ddplab`` stays light.
__all__ = ["CourseError", "copy_notebooks", "reference_dir", "reference_notebooks"]


def copy_notebooks(dest: str | Path, reference: bool = False) -> tuple[list[Path], list[Path]]:
    """Write the student (or reference) versions into ``dest``; return (written, kept).

    A notebook already in ``dest`` is kept as it is, never overwritten.
    """
    import nbformat

    from .release import release_notebook

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for source in reference_notebooks():
        target = dest / source.name
        if target.exists():
            kept.append(target)
        elif reference:
            shutil.copyfile(source, target)
            written.append(target)
        else:
            nbformat.write(release_notebook(nbformat.read(source, as_version=4), source.name), target)
            written.append(target)
    return written, kept
