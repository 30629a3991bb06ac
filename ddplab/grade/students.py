"""Whose work a hand-in is: the rule that names a student from the folders ``ddplab grade`` is given.

The rule, as docs/instructors.md states it:

1. **A student is the folder that holds their notebooks**, at one depth for
   the whole folder named (the *student depth*): the depth of the shallowest
   notebook under it. ``class/alice/01.ipynb`` is Alice's (depth 1);
   ``class/sec1/alice/01.ipynb`` and ``class/sec1/bob/01.ipynb`` are Alice's
   and Bob's, in section ``sec1`` (depth 2). The folders above the student's
   are their section. Deeper folders are the student's own
   (``alice/late/01.ipynb`` is a second copy of Alice's, never a student
   called ``late``): a student writes inside their folder, never beside it,
   so no hand-in can create or take another student's row.
2. **nbgrader's layout** ``submitted/<student>/<assignment>/``: wherever a
   path has a folder named ``submitted``, the student is the folder under
   it, whatever was named (``submitted/``, ``submitted/*/ps1``, one student's
   folder or one file in it). ``submitted/alice/ps1/`` and
   ``submitted/alice/ps1_late/`` are both Alice's.
3. **A flat folder**: a notebook directly in the folder named is that
   folder's student when its name is one of the course's notebooks
   (``ddplab grade alice/``), else its own student, by file name
   (``submitted/alice.ipynb``).
4. ``--student-depth N`` says it outright, for a layout the rule reads
   another way: ``class/alice/ps1/`` and ``class/alice/ps1_late/`` (no
   ``submitted`` folder) read as students ``ps1`` and ``ps1_late`` in section
   ``alice``; ``--student-depth 1`` makes them Alice's. ``0``: everything
   named is one student's.

Two students are never merged: a student is a folder, and two folders are two
rows (``sec1/alice`` and ``sec2/alice`` are two Alices, in two sections).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The folder nbgrader collects hand-ins in: ``submitted/<student>/<assignment>/<notebook>``.
NBGRADER_FOLDER = "submitted"


@dataclass(frozen=True)
class Owner:
    """Whose an entry is: the student's name, their section, and their folder (the identity)."""
    student: str
    section: str
    folder: Path
    #: Why the entry is not in a student's folder ("" when it is): with ``--student-depth``.
    outside: str = ""


def _under_submitted(root: Path, folders: tuple[str, ...]) -> Owner | None:
    """nbgrader's student, where the path has ``submitted/<student>/``; else None.

    Above the folder named (it is inside one student's folder), the last
    ``submitted`` counts; below it, the first: a folder called ``submitted``
    that a student makes inside their own never names another student.
    """
    whole = root.absolute().parts
    if NBGRADER_FOLDER in whole[:-1]:
        at = len(whole) - whole[::-1].index(NBGRADER_FOLDER)
        return Owner(whole[at], "", Path(*whole[:at + 1]))
    if NBGRADER_FOLDER in folders[:-1] and whole[-1] != NBGRADER_FOLDER:
        at = folders.index(NBGRADER_FOLDER) + 1
        return Owner(folders[at], "", root.joinpath(*folders[:at + 1]))
    return None


def depth_of(root: Path, entries: list[Path], reference_names: set[str],
             asked: int | None) -> int:
    """The student depth under ``root``: ``asked`` if given, else rule 1 to 3 of the docstring.

    ``entries`` are the notebook-named entries (files or not) under ``root``.
    """
    if asked is not None:
        return asked
    if root.absolute().name == NBGRADER_FOLDER:
        return 1
    depths = [len(e.relative_to(root).parts) - 1 for e in entries]
    if any(d == 0 and e.name in reference_names for d, e in zip(depths, entries)):
        return 0                                 # a folder of one student's notebooks
    return min((d for d in depths if d > 0), default=1)


def owner(entry: Path, root: Path, depth: int, asked: bool = False,
          is_folder: bool = False) -> Owner:
    """Whose ``entry`` (under the folder named ``root``) is, at student depth ``depth``.

    ``is_folder``: the entry is a folder (a link to one), not a notebook: its own
    name is a folder of the path. ``asked``: the depth came from ``--student-depth``.
    """
    relative = entry.relative_to(root).parts
    folders = relative if is_folder else relative[:-1]
    # A submitted/ below the student depth is a folder some student made: it names no one.
    nbgrader = None if asked else _under_submitted(root, folders[:depth])
    if nbgrader is not None:
        return nbgrader
    if depth == 0:
        return Owner(root.absolute().name, "", root)
    if not folders:                              # directly in the folder named: a flat folder
        return Owner(Path(relative[-1]).stem, "", entry)
    if len(folders) < depth:                     # a link beside the students, or not as asked
        return Owner(folders[-1], "/".join(folders[:-1]), root.joinpath(*folders),
                     f"is not in a student's folder: with --student-depth {depth}, a student's "
                     f"notebooks are {depth} folders under {root}" if asked else "")
    return Owner(folders[depth - 1], "/".join(folders[:depth - 1]), root.joinpath(*folders[:depth]))


def owner_of_file(path: Path, reference_names: set[str]) -> Owner:
    """Whose a notebook named alone on the command line is: nbgrader's student, its folder's
    student when it has a course notebook's name, else its own (``alice.ipynb``)."""
    nbgrader = _under_submitted(path.parent, ())
    if nbgrader is not None:
        return nbgrader
    if path.name in reference_names and path.parent.name not in ("", "."):
        return Owner(path.parent.name, "", path.parent)
    return Owner(path.stem, "", path)


def say_layout(root: Path, depth: int, owners: list[Owner], entries: list[Path]) -> None:
    """Warn where the rule read a layout one way that could be meant another (only when the
    depth was not asked for): the instructor sees it once, with the option that says otherwise."""
    if depth >= 2:
        sections = sorted({o.section for o in owners if o.section})
        log.warning("ddplab grade: under %s, students are the folders %d deep (<section>/<student>/, "
                    "sections: %s), where its shallowest notebooks lie. If the first folder under "
                    "it is the student (alice/ps1/...), pass --student-depth 1.", root, depth,
                    ", ".join(sections[:5]) + ("..." if len(sections) > 5 else ""))
    # A student's folder holding several folders of notebooks: their copies, or students of
    # a section one level deeper than the others.
    nested: dict[Path, set[str]] = {}
    for o, entry in zip(owners, entries):
        if o.folder in entry.parents and len(entry.relative_to(o.folder).parts) > 1:
            nested.setdefault(o.folder, set()).add(entry.relative_to(o.folder).parts[0])
    for folder, inner in nested.items():
        if len(inner) > 1:
            log.warning("ddplab grade: %s holds %d folders of notebooks (%s): graded as copies of "
                        "one student's work. If they are students, pass --student-depth %d.",
                        folder, len(inner), ", ".join(sorted(inner)[:3]), depth + 1)
