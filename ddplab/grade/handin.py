"""What was handed in: the submissions under the folders ``ddplab grade`` is given, read as untrusted input.

A hand-in folder is written by the students, and the grader reads it with the
instructor's rights. So nothing in it is followed or opened before it is known
to be what it claims to be:

- a **symbolic link** (to a file or a folder) is never followed: a link named
  ``mallory/06_build_all_reduce.ipynb`` pointing at the reference notebook, or
  at any file the grader can read, would otherwise be graded as Mallory's;
- anything that is not a **regular file** (a FIFO, a socket, a device, a folder
  named like a notebook) is never opened: opening a FIFO waits for a writer,
  and would stop the whole class. ``lstat`` decides first; the open itself is
  non-blocking and never follows a link (``O_NONBLOCK | O_NOFOLLOW``), and
  ``fstat`` checks what was opened, in case the entry was swapped since;
- a file over ``MAX_SUBMISSION_BYTES`` is not read;
- **one graded copy per notebook per student**. Whose an entry is follows
  ``ddplab.grade.students`` (a student is the folder that holds their
  notebooks; sections, nbgrader's layout, ``--student-depth``). A student
  who handed in one notebook twice (``alice/ps1/`` and ``alice/ps1_late/``) is
  one row, graded on the newest copy (modification time; then the
  shallowest, then by name), the others listed with it, never a row of zero
  beside it. A copy that cannot be graded (a link, a FIFO) gives way to one
  that can.

Each refused entry is still reported with its reason: the run always completes
and reports every student.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from . import students
from .students import Owner

__all__ = ["MAX_SUBMISSION_BYTES", "HandIn", "handed_in", "read_bytes", "read_text"]

#: The largest notebook graded. The course's largest reference, outputs and
#: pictures in, is well under 1 MB; a submission 30 times that is not work.
MAX_SUBMISSION_BYTES = 32 * 2**20


@dataclass(frozen=True)
class HandIn:
    """One student's submission of one notebook: its file, whose it is, and why it is not graded
    (``refused``, or ""); ``copies``: the student's other copies of it, each with why it was not
    the one graded."""
    path: Path
    student: str
    refused: str = ""
    section: str = ""
    copies: tuple[str, ...] = ()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "of an unknown kind"


def _why_not(path: Path) -> str:
    """Why the entry at ``path`` is not read as a notebook ("" when it is fine), from lstat only."""
    try:
        info = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return ("is a symbolic link; ddplab grade never follows links in a hand-in folder "
                "(it would read the link's target with the grader's rights). Hand in the file itself")
    if not stat.S_ISREG(info.st_mode):
        return f"is not a regular file ({_kind(info.st_mode)}); hand in the notebook file itself"
    if info.st_size > MAX_SUBMISSION_BYTES:
        return (f"is {info.st_size / 2**20:.0f} MB, over the {MAX_SUBMISSION_BYTES // 2**20} MB a "
                f"submission may be; clear its outputs (Edit > Clear Outputs of All Cells) "
                f"and hand it in again")
    return ""


def _entries(root: Path) -> list[Path]:
    """Every ``.ipynb`` entry (a folder so named too, not entered) and every linked folder under
    ``root``, without following links; by path."""
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=False):
        here = Path(folder)
        subfolders.sort()
        found += [here / d for d in subfolders if (here / d).is_symlink() or d.endswith(".ipynb")]
        subfolders[:] = [d for d in subfolders if d != ".ipynb_checkpoints"
                         and not d.endswith(".ipynb") and not (here / d).is_symlink()]
        found += [here / f for f in files if f.endswith(".ipynb")]
    return sorted(found, key=lambda p: p.parts)


@dataclass
class _Found:
    path: Path
    owner: Owner
    refused: str


def handed_in(paths: list[str | Path], reference_names: set[str],
              student_depth: int | None = None) -> list[HandIn]:
    """The submissions in ``paths`` (notebooks, or folders of them): one per student and notebook.

    ``reference_names`` are the course's notebook file names (``alice/01_x.ipynb``
    is Alice's, ``alice.ipynb`` too); ``student_depth``: ``--student-depth``
    (``ddplab.grade.students``). Raises FileNotFoundError for a path that
    does not exist or is neither a notebook nor a folder (the command is wrong);
    everything found inside a folder comes back, refused or not.
    """
    found: dict[Path, _Found] = {}
    for named in map(Path, paths):
        for entry in _named(named, reference_names, student_depth):
            found.setdefault(entry.path.absolute(), entry)      # a file named twice is one submission
    return _one_per_student(list(found.values()))


def _named(named: Path, reference_names: set[str], asked: int | None) -> list[_Found]:
    """The entries in one path given on the command line, each with its owner."""
    if named.is_dir():                   # a folder the instructor names is trusted; links in it are not
        entries = _entries(named)
        notebooks = [e for e in entries if e.suffix == ".ipynb"]
        depth = students.depth_of(named, notebooks, reference_names, asked)
        owners = [students.owner(e, named, depth, asked is not None,
                                 is_folder=e.suffix != ".ipynb") for e in entries]
        if asked is None:
            students.say_layout(named, depth, owners, entries)
        return [_Found(e, o, o.outside or _why_not(e)) for e, o in zip(entries, owners)]
    if named.suffix == ".ipynb" and (named.exists() or named.is_symlink()):
        return [_Found(named, students.owner_of_file(named, reference_names), _why_not(named))]
    if not named.exists():
        raise FileNotFoundError(f"ddplab: {named} does not exist. Check the path, and name "
                                f"notebooks (.ipynb) or folders that hold them.")
    raise FileNotFoundError(f"ddplab: {named} is neither a notebook (.ipynb) nor a folder. "
                            f"Name notebooks or folders that hold them.")


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _one_per_student(found: list[_Found]) -> list[HandIn]:
    """One HandIn per student and notebook, in the order found; two folders are never one student."""
    by_student: dict[tuple[Path, str], list[_Found]] = {}
    for entry in found:
        by_student.setdefault((entry.owner.folder.absolute(), entry.path.name), []).append(entry)
    # Two folders named alike (``ddplab grade sec1/ sec2/``, each with an alice) stay two rows:
    # the second is told apart by the path of its folder.
    names: dict[tuple[str, str], Path] = {}
    shown: dict[Path, str] = {}
    for folder, _ in by_student:
        entry = by_student[(folder, _)][0]
        pair = (entry.owner.section, entry.owner.student)
        if names.setdefault(pair, folder) != folder:
            shown[folder] = str(entry.owner.folder.parent)
    handins = []
    for (folder, _), copies in by_student.items():
        # The newest copy that can be graded; then the shallowest, then by name.
        copies.sort(key=lambda e: (bool(e.refused), -_mtime(e.path), len(e.path.parts), e.path.parts))
        graded, others = copies[0], copies[1:]
        notes = tuple(f"{e.path} ({e.refused or 'an older copy'})" for e in others)
        owner = graded.owner
        handins.append(HandIn(graded.path, owner.student, graded.refused,
                              shown.get(folder, owner.section), notes))
    return handins


def read_bytes(path: Path) -> bytes:
    """The file's bytes, opened without following a link or waiting on a FIFO.

    ValueError with a one-line reason (as ``plan.load_submission`` gives) if it is
    not a regular file of at most ``MAX_SUBMISSION_BYTES``: it may have changed
    since ``handed_in`` listed it. The second guard after ``_why_not``'s lstat:
    the open cannot block (``O_NONBLOCK``) or follow a link (``O_NOFOLLOW``), and
    ``fstat`` checks what was opened before a byte is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read the file ({e.strerror}; a symbolic link is never followed)") from e
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the file is not a regular file ({_kind(info.st_mode)})")
        if info.st_size > MAX_SUBMISSION_BYTES:
            raise ValueError(f"the file is over the {MAX_SUBMISSION_BYTES // 2**20} MB a submission may be")
        data = file.read(MAX_SUBMISSION_BYTES + 1)
    if len(data) > MAX_SUBMISSION_BYTES:
        raise ValueError(f"the file is over the {MAX_SUBMISSION_BYTES // 2**20} MB a submission may be")
    return data


def read_text(path: Path) -> str:
    """``read_bytes``, decoded as UTF-8; ValueError with the reason if it cannot be."""
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read the file ({e})") from e
