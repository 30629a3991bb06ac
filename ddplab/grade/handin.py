"""What was handed in: the submissions under the folders ``ddplab grade`` is given, read as untrusted input.

A hand-in folder is written by the students, and the grader reads it with the
instructor's rights. So nothing in it is followed or opened before it is known
to be what it claims to be:

- a **symbolic link** (to a file or a folder) is never followed: a link named
  ``mallory/06_build_all_reduce.ipynb`` pointing at the reference notebook, or
  at any file the grader can read, would otherwise be graded as Mallory's;
- anything that is not a **regular file** (a FIFO, a device, a socket) is never
  opened: opening a FIFO waits for a writer, and would stop the whole class;
- a file over ``MAX_SUBMISSION_BYTES`` is not read;
- **one submission per notebook per student**: the student is the first folder
  under the folder named (``submitted/alice/...``, however deep nbgrader's
  layout puts the file: ``submitted/alice/ps1/01_x.ipynb`` is Alice's), so a
  second copy deeper in Alice's folder (``alice/zoe/01_x.ipynb``) is refused,
  not graded as a student called ``zoe``. Wherever a path has nbgrader's
  ``submitted/<student>/<assignment>/`` in it, the student is the folder under
  ``submitted``, however the paths were named (``submitted/*/ps1``, or a
  student's folder alone): not ``ps1`` for all. Two paths named that hold one
  student's notebook twice: the first is graded, the second refused.

Each refused entry is still a row of the class's report, with its reason: the
run always completes and reports every submission. ``read_text`` opens a file
without following a link and checks what it opened, so a file swapped for a
link or a FIFO after it was listed is refused too.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_SUBMISSION_BYTES", "HandIn", "handed_in", "read_text"]

#: The largest notebook graded. The course's largest reference, outputs and
#: pictures in, is well under 1 MB; a submission 30 times that is not work.
MAX_SUBMISSION_BYTES = 32 * 2**20


@dataclass(frozen=True)
class HandIn:
    """One submission found: whose it is, and why it is not graded (``refused``, or "")."""
    path: Path
    student: str
    refused: str = ""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


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
        return f"is {_kind(info.st_mode)}, not a notebook file; hand in the .ipynb file itself"
    if info.st_size > MAX_SUBMISSION_BYTES:
        return (f"is {info.st_size / 2**20:.0f} MB, over the {MAX_SUBMISSION_BYTES // 2**20} MB a "
                f"submission may be; clear its outputs (Edit > Clear Outputs of All Cells) "
                f"and hand it in again")
    return ""


#: The folder nbgrader collects hand-ins in: ``submitted/<student>/<assignment>/<notebook>``.
NBGRADER_FOLDER = "submitted"


def _student(path: Path, root: Path | None, reference_names: set[str]) -> str:
    # Named below nbgrader's submitted/<student>/ (submitted/*/ps1, a student's folder, a file
    # in it): the student is the folder under submitted, not the first one under what was named.
    named = (root if root is not None else path.parent).absolute().parts
    if NBGRADER_FOLDER in named[:-1]:
        return named[len(named) - named[::-1].index(NBGRADER_FOLDER)]
    if root is not None:
        parts = path.relative_to(root).parts
        if len(parts) > 1:
            return parts[0]                  # submitted/alice/..., however deep
        if path.name in reference_names:
            return root.name                 # a folder of one student's notebooks
        return path.stem                     # submitted/alice.ipynb
    if path.name in reference_names and path.parent.name not in ("", "."):
        return path.parent.name              # a file named on the command line
    return path.stem


def _entries(root: Path) -> list[Path]:
    """Every ``.ipynb`` entry and every linked folder under ``root``, without following links."""
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=False):
        here = Path(folder)
        subfolders[:] = sorted(d for d in subfolders if d != ".ipynb_checkpoints")
        found += [here / d for d in subfolders if (here / d).is_symlink()]
        found += [here / f for f in files if f.endswith(".ipynb")]
    # By student; within a student's folder, the shallowest first (the one graded).
    return sorted(found, key=lambda p: (p.relative_to(root).parts[0], len(p.parts), p))


def handed_in(paths: list[str | Path], reference_names: set[str]) -> list[HandIn]:
    """The submissions in ``paths`` (notebooks, or folders of them), each with its student.

    ``reference_names`` are the course's notebook file names: ``alice/01_x.ipynb``
    is Alice's, ``alice.ipynb`` too. Raises FileNotFoundError for a path that
    does not exist or is neither a notebook nor a folder (the command is wrong);
    everything found inside a folder comes back, refused or not.
    """
    found: list[HandIn] = []
    seen: set[Path] = set()
    first: dict[tuple[str, str], Path] = {}
    for named in map(Path, paths):
        for handin in _named(named, reference_names):
            if handin.path.absolute() in seen:           # a file named twice is one submission
                continue
            seen.add(handin.path.absolute())
            graded = first.setdefault((handin.student, handin.path.name), handin.path)
            if not handin.refused and graded != handin.path:   # named apart: submitted/*/ps1
                handin = HandIn(handin.path, handin.student,
                                f"is a second {handin.path.name} of {handin.student}'s; one "
                                f"submission per notebook per student: {graded} is the one graded")
            found.append(handin)
    return found


def _named(named: Path, reference_names: set[str]) -> list[HandIn]:
    """The submissions in one path given on the command line."""
    if named.is_dir():                   # a folder the instructor names is trusted; links in it are not
        found, first = [], {}
        for path in _entries(named):
            student = _student(path, named, reference_names)
            refused = _why_not(path)
            if not refused and path.suffix == ".ipynb":
                graded = first.setdefault((student, path.name), path)
                if graded != path:
                    refused = (f"is a second {path.name} in {student}'s folder; one submission per "
                               f"notebook per student: {graded.relative_to(named)} is the one graded")
            found.append(HandIn(path, student, refused))
        return found
    if named.suffix == ".ipynb" and (named.exists() or named.is_symlink()):
        return [HandIn(named, _student(named, None, reference_names), _why_not(named))]
    if not named.exists():
        raise FileNotFoundError(f"ddplab: {named} does not exist. Check the path, and name "
                                f"notebooks (.ipynb) or folders that hold them.")
    raise FileNotFoundError(f"ddplab: {named} is neither a notebook (.ipynb) nor a folder. "
                            f"Name notebooks or folders that hold them.")


def read_text(path: Path) -> str:
    """The file's text, opened without following a link or waiting on a FIFO.

    ValueError with a one-line reason (as ``plan.load_submission`` gives) if it is
    not a regular UTF-8 file of at most ``MAX_SUBMISSION_BYTES``: it may have
    changed since ``handed_in`` listed it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            data = file.read(MAX_SUBMISSION_BYTES + 1) if stat.S_ISREG(mode) else b""
    except OSError as e:
        raise ValueError(f"cannot read the file ({e.strerror}; a symbolic link is never followed)") from e
    if not stat.S_ISREG(mode):
        raise ValueError(f"the file is {_kind(mode)}, not a notebook file")
    if len(data) > MAX_SUBMISSION_BYTES:
        raise ValueError(f"the file is over the {MAX_SUBMISSION_BYTES // 2**20} MB a submission may be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read the file ({e})") from e
