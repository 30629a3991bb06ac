"""The course notebooks that ship with ddplab: copies for students and for instructors.

An installed ddplab (``pip install ddplab``) carries the reference notebooks
in ``ddplab/course/notebooks/`` (copied from the repository's ``notebooks/``
when the wheel is built); a checkout reads ``notebooks/`` itself.

    ddplab notebooks course/               # the student versions, solutions stubbed
    ddplab notebooks course/ --reference   # the reference versions, solutions in
    ddplab remove-solutions                # for a graded term: this installation keeps none

``remove-solutions`` turns the notebooks an installed ddplab carries into
their student versions, in place, and leaves a mark: ``ddplab.solution`` and
``ddplab notebooks --reference`` then say the solutions were removed, and
``ddplab.hint`` still helps (the hints are in the released cells' metadata).
Run it once, as the owner of the environment (root on a class server), after
``pip install``. The reference notebooks for grading stay with the instructor.

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

from ..hints import (
    REMOVED_MARK,
    reference_dir,
    reference_notebooks,
    refuse_if_removed,
    shipped_dir,
    solutions_removed,
)

# nbformat and .release are imported where used: ``import ddplab`` stays light.
__all__ = ["CourseError", "copy_notebooks", "reference_dir", "reference_notebooks", "remove_solutions"]


def copy_notebooks(dest: str | Path, reference: bool = False) -> tuple[list[Path], list[Path]]:
    """Write the student (or reference) versions into ``dest``; return (written, kept).

    A notebook already in ``dest`` is kept as it is, never overwritten. Beside the
    student versions go the student's JupyterLab settings (``lab_settings``).
    """
    import nbformat

    from .lab_settings import write_lab_settings
    from .release import release_notebook

    if reference:
        refuse_if_removed("ddplab notebooks --reference")
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
    if not reference:
        write_lab_settings(dest)
    return written, kept


def remove_solutions() -> list[Path]:
    """Replace the notebooks this installed ddplab carries by their student versions; return them.

    Refused in a checkout (its ``notebooks/`` is the course's source, not an
    installation's copy). Each notebook is rewritten whole or not at all.
    """
    import nbformat

    from ..grade.journal import write_atomically
    from .release import release_notebook

    folder = reference_dir()
    if folder != shipped_dir():
        raise CourseError(f"ddplab remove-solutions: {folder} is a checkout's notebooks folder, the "
                          f"course's source. Install ddplab (pip install .) into the students' "
                          f"environment and run it there.")
    if solutions_removed():
        return []
    rewritten = []
    for path in reference_notebooks():
        released = release_notebook(nbformat.read(path, as_version=4), path.name)
        write_atomically(path, nbformat.writes(released))
        rewritten.append(path)
    (folder / REMOVED_MARK).write_text("ddplab remove-solutions: these are the student versions.\n")
    return rewritten
