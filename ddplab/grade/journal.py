"""What ``ddplab grade`` writes, checked before grading starts and written so no run loses it.

- ``positive``, ``writable``: the command line's values and output paths are
  checked before the first submission is graded; a mistake is one line and
  exit 2, not a traceback after the whole class was graded.
- ``write_atomically``: a CSV or JUnit file is either the old one or the new
  one, never half of each (a temporary file beside it, then ``os.replace``).
- ``Journal``: every finished submission is appended (one JSON line, flushed
  and fsync'ed) to ``<output>.journal`` as it finishes. A run that is killed,
  whatever killed it, loses no finished result: ``ddplab grade ... --resume``
  keeps what the journal holds and grades only the rest. A submission whose
  file changed since is graded again (the journal keys by content).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path

from ..errors import GradeError
from .handin import read_bytes


def positive(option: str, value, default, what: str = "the default"):
    """``value`` if it is a positive finite number, ``default`` if it is None; else GradeError."""
    if value is None:
        return default
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise GradeError(f"ddplab grade: {option} {value} is not a positive number; it must be "
                         f"more than 0 (leave it out for {what}).")
    return value


def writable(option: str, path: str, inputs: list[str]) -> Path:
    """``path`` as a Path, once it is known that grades can be written there; else GradeError."""
    target = Path(path)
    taken = {Path(p).resolve() for p in inputs}
    if target.is_dir():
        raise GradeError(f"ddplab grade: {option} {path} is a folder. Name a file in it, "
                         f"e.g. {target / 'grades'}{'.csv' if option == '--csv' else '.xml'}.")
    if target.suffix == ".ipynb" or target.resolve() in taken:
        raise GradeError(f"ddplab grade: {option} {path} would overwrite a notebook or a "
                         f"folder being graded. Name a new file, e.g. grades.csv.")
    folder = target.parent
    if folder.exists() and not folder.is_dir():
        raise GradeError(f"ddplab grade: {option} {path}: {folder} is a file, not a folder. "
                         f"Name a file in a folder.")
    if not folder.is_dir():
        raise GradeError(f"ddplab grade: {option} {path}: the folder {folder} does not exist. "
                         f"Create it first, or name a file in an existing folder.")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}."):
            pass
    except OSError as e:
        raise GradeError(f"ddplab grade: {option} {path} cannot be written ({e.strerror}). "
                         f"Name a file in a folder you can write to.") from e
    return target


def write_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step: readers see the old file or the new, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def journal_for(targets: list[Path], resume: bool = False) -> "Journal | None":
    """The journal beside the first output file (None without one); checked for ``--resume``."""
    if not targets:
        if resume:
            raise GradeError("ddplab grade: --resume needs --csv or --junit: the journal of "
                             "finished results is kept beside that file.")
        return None
    journal = Journal(targets[0].with_name(targets[0].name + ".journal"))
    if resume and not journal.path.exists():
        raise GradeError(f"ddplab grade: --resume found no journal at {journal.path}. Give the "
                         f"same --csv/--junit as the run to resume, or leave out --resume.")
    if not resume:
        journal.path.unlink(missing_ok=True)
    return journal


def key(submission: Path, reference: Path) -> str:
    """What a journal entry is for: the submission's content and the reference's path."""
    try:                    # opened as a hand-in is: never a FIFO, never through a link
        digest = hashlib.sha256(read_bytes(Path(submission))).hexdigest()
    except ValueError:
        digest = "unreadable-" + os.urandom(8).hex()    # never matched: graded again on --resume
    return f"{digest}:{Path(reference).resolve()}:{Path(submission).resolve()}"


class Journal:
    """Finished grades, one JSON line each, appended as they finish."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def done(self) -> dict[str, dict]:
        """Key -> the Grade's fields, for every complete line (a torn last line is ignored)."""
        found = {}
        if not self.path.exists():
            return found
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
                found[entry["key"]] = entry["grade"]
            except (ValueError, KeyError, TypeError):
                continue
        return found

    def record(self, entry_key: str, grade) -> None:
        line = json.dumps({"key": entry_key, "grade": asdict(grade)}) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> None:
        """The run reported everything: the journal is no longer needed."""
        self.path.unlink(missing_ok=True)
