"""Help with one exercise of the course notebooks, from a cell: its hint, then its solution.

A stuck student asks by the exercise's name, its cell id without ``exercise-``::

    ddplab.hint("ping-pong")        # the hint its author wrote
    ddplab.solution("ping-pong")    # the reference solution

Each exercise's text in the notebook ends with its line, ``Stuck?
`ddplab.hint("ping-pong")```. Names are lower-case words joined by hyphens
(``global-mean``, ``tcp-group-rank-0``); the spellings of earlier versions
(``global_mean``, ``Global Mean``) find the same exercise, and a near miss
is answered with the names it is closest to.

A hint lives in the exercise cell's metadata, ``{"ddplab": {"hint": "..."}}``;
the solution is the reference cell, between the marker lines ``BEGIN`` and
``END`` (what ``ddplab release`` replaces by a stub, ``ddplab.course.release``).

The reference notebooks are read where they are: an installed ddplab carries
them in ``ddplab/course/notebooks/`` (copied from the repository's
``notebooks/`` when the wheel is built); a checkout reads ``notebooks/``.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .errors import CourseError

# The notebooks are read as plain JSON, not through nbformat: importing nbformat (its
# jsonschema validator compiles a grammar on import) made a student's first
# ddplab.hint take 1 s on an idle machine and 11-12 s on a loaded one.

EXERCISE_PREFIX = "exercise-"
#: The lines around a solution in an exercise cell (nbgrader's).
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"


#: Left beside the shipped notebooks by ``ddplab remove-solutions``.
REMOVED_MARK = "SOLUTIONS-REMOVED"


def shipped_dir() -> Path:
    """Where an installed ddplab carries the course notebooks (a wheel copies them there)."""
    return Path(__file__).resolve().parent / "course" / "notebooks"


def solutions_removed() -> bool:
    """Whether this installation's notebooks are the student versions (``ddplab remove-solutions``)."""
    return (shipped_dir() / REMOVED_MARK).exists()


def refuse_if_removed(what: str) -> None:
    if solutions_removed():
        raise CourseError(f"ddplab: {what}: this installation has no solutions (they were removed "
                          f"for a graded term with `ddplab remove-solutions`). ddplab.hint(name) "
                          f"still gives each exercise's hint.")


def reference_dir() -> Path:
    """The folder of reference notebooks: the installed package's, else the checkout's."""
    package = Path(__file__).resolve().parent / "course"   # where a wheel carries them
    for folder in (shipped_dir(), package.parents[1] / "notebooks"):
        if any(folder.glob("*.ipynb")):
            return folder
    raise CourseError(f"ddplab: no course notebooks in {package / 'notebooks'} nor in "
                      f"{package.parents[1] / 'notebooks'}. Reinstall ddplab from a wheel or sdist "
                      f"(they ship the notebooks), or run from a checkout of the repository.")


def reference_notebooks() -> list[Path]:
    return sorted(reference_dir().glob("*.ipynb"))


@dataclass
class Exercise:
    """An exercise cell of a reference notebook, as ``hint`` and ``solution`` read it."""
    notebook: str
    source: str
    metadata: dict = field(default_factory=dict)


def spelling(name: str) -> str:
    """The one spelling of an exercise name: lower case, words joined by hyphens.

    ``exercise-`` in front (the cell id) is dropped, and underscores and spaces
    (``global_mean``, ``Global mean``, the spellings of earlier versions) become hyphens.
    """
    key = name.strip().lower()
    key = key[len(EXERCISE_PREFIX):] if key.startswith(EXERCISE_PREFIX) else key
    return re.sub(r"[\s_-]+", "-", key).strip("-")


@lru_cache(maxsize=4)
def _read(folder: Path, stamps: tuple) -> dict[str, Exercise]:
    found: dict[str, Exercise] = {}
    for path, _ in stamps:
        with open(path, encoding="utf-8") as f:
            cells = json.load(f).get("cells", [])
        for cell in cells:
            cell_id = cell.get("id", "")
            if cell.get("cell_type") == "code" and cell_id.startswith(EXERCISE_PREFIX):
                source = cell.get("source", "")
                found.setdefault(spelling(cell_id), Exercise(
                    Path(path).name, "".join(source) if isinstance(source, list) else source,
                    cell.get("metadata", {})))
    return found


def exercises() -> dict[str, Exercise]:
    """Exercise name -> its notebook and exercise cell, over every reference notebook.

    Read once per kernel, and again only when a notebook changed on disk.
    """
    folder = reference_dir()
    stamps = tuple((str(p), p.stat().st_mtime_ns) for p in reference_notebooks())
    return _read(folder, stamps)


def _exercise(name: str) -> tuple[str, Exercise]:
    if not isinstance(name, str):
        raise CourseError(f"ddplab: an exercise is named by a string, e.g. ddplab.hint(\"ping-pong\"), "
                          f"but got {name!r} ({type(name).__name__}). The name is in the line under "
                          f"its exercise's text: Stuck? ddplab.hint(\"...\").")
    known = exercises()
    key = spelling(name)
    if key in known:
        return key, known[key]
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    if close:
        options = " or ".join(f"{n!r} ({known[n].notebook[:-6]})" for n in close)
        raise CourseError(f"ddplab: no exercise named {name!r}. Did you mean {options}? The name is "
                          f"the one in the line under its exercise's text: Stuck? ddplab.hint(\"...\").")
    notebooks = sorted({ex.notebook for ex in known.values()})
    raise CourseError(f"ddplab: no exercise named {name!r}, nor one close to it. Each exercise's text "
                      f"ends with its line, e.g. Stuck? ddplab.hint(\"ping-pong\"), in the notebooks "
                      f"{notebooks[0][:2]} to {notebooks[-1][:2]}; ddplab.hints.exercises() lists "
                      f"all {len(known)}.")


def hint_text(name: str) -> str:
    key, exercise = _exercise(name)
    hint = exercise.metadata.get("ddplab", {}).get("hint")
    if not hint:
        return (f"No hint was written for {key} ({exercise.notebook})." if solutions_removed() else
                f"No hint was written for {key} ({exercise.notebook}). "
                f"ddplab.solution({key!r}) shows the reference solution.")
    return f"Hint for {key} ({exercise.notebook}): {hint}"


def solution_text(name: str) -> str:
    """The reference exercise cell, marker lines left out, ready to paste over the stub."""
    refuse_if_removed(f"ddplab.solution({name!r})")
    key, exercise = _exercise(name)
    body = "\n".join(line for line in exercise.source.splitlines() if line.strip() not in (BEGIN, END))
    return f"# Reference solution of {key} ({exercise.notebook}):\n{body}"


def hint(name: str) -> None:
    """Print the hint for exercise ``name`` (its cell id without ``exercise-``)."""
    print(hint_text(name))


def solution(name: str) -> None:
    """Print the reference solution of exercise ``name``; try ``ddplab.hint`` first."""
    print(solution_text(name))
