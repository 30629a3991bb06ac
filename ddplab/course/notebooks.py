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
with the notebooks that are new, keeping the rest. An entry that is in the way
and is not a notebook (a link to a file that is gone, a folder) is left as it
is and reported with its fix, and the other notebooks are still written; a
destination that cannot be a folder stops it, in one line with the fix.

Where the reference notebooks are (``reference_dir``), and the hints and
solutions a student asks for from a cell, live in ``ddplab.hints``.
"""

from __future__ import annotations

import os
import tempfile
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


def copy_notebooks(dest: str | Path, reference: bool = False) -> tuple[list[Path], list[Path], list[str]]:
    """Write the student (or reference) versions into ``dest``; return (written, kept, refused).

    A notebook already in ``dest`` is kept as it is, never overwritten. ``refused``
    says, one line each, which entries were in the way and how to clear them; the
    other notebooks are written all the same. CourseError if ``dest`` cannot be a
    folder. Beside the student versions go the student's JupyterLab settings
    (``lab_settings``).
    """
    import nbformat

    from .lab_settings import write_lab_settings
    from .release import release_notebook

    if reference:
        refuse_if_removed("ddplab notebooks --reference")
    dest = Path(dest)
    _make_folder(dest)
    written, kept, refused = [], [], []
    for source in reference_notebooks():
        target = dest / source.name
        if target.is_symlink() and not target.exists():
            # Writing through it would put the notebook wherever the link points.
            refused.append(f"{target} is a link to {os.readlink(target)}, which does not exist: "
                           f"left as it is (your work may be where it pointed). Remove the link "
                           f"(rm {target}) and run this again for a fresh copy.")
        elif target.exists() and not target.is_file():
            refused.append(f"{target} is a folder, not a notebook: left as it is. Rename it and "
                           f"run this again for a fresh copy.")
        elif target.exists():
            kept.append(target)
        else:
            try:
                text = (source.read_text(encoding="utf-8") if reference else nbformat.writes(
                    release_notebook(nbformat.read(source, as_version=4), source.name)))
                _write_new(target, text)
                written.append(target)
            except FileExistsError:
                kept.append(target)            # it appeared meanwhile: someone's work
            except OSError as e:
                refused.append(f"{target} could not be written ({e.strerror}). Free space or fix "
                               f"the folder's permissions, then run this again.")
    if not reference:
        write_lab_settings(dest)
    return written, kept, refused


def _make_folder(dest: Path) -> None:
    """``dest`` as a folder (made with its parents); CourseError saying why it cannot be one."""
    if dest.is_symlink() and not dest.exists():
        raise CourseError(f"ddplab notebooks: {dest} is a link to {os.readlink(dest)}, which does not "
                          f"exist. Make that folder, or name another one.")
    if dest.exists() and not dest.is_dir():
        raise CourseError(f"ddplab notebooks: {dest} is a file; the notebooks go into a folder. Name "
                          f"a folder (it is made if it does not exist), e.g. ddplab notebooks "
                          f"{dest}-course.")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        found = next((p for p in dest.parents if p.exists() or p.is_symlink()), None)
        where = (f"{found} is a file" if found is not None and not found.is_dir() else
                 f"{found} does not let you make folders in it ({e.strerror})" if found is not None
                 else e.strerror)
        raise CourseError(f"ddplab notebooks: cannot make the folder {dest}: {where}. Name a folder "
                          f"you can write to, e.g. ddplab notebooks ~/ddplab-course.") from e


def _write_new(target: Path, text: str) -> None:
    """Write ``target`` whole or not at all, never over a file that appeared meanwhile.

    A temporary file beside it, then a hard link to the name (which fails if the name is
    taken); where the file system has no hard links, a rename after a last look.
    """
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            os.link(temporary, target)
        except FileExistsError:
            raise
        except OSError:
            if os.path.lexists(target):
                raise FileExistsError(target) from None
            os.replace(temporary, target)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


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
