"""Help with one exercise of the course notebooks, from a cell: its hint, then its solution.

A stuck student asks by the exercise's name, its cell id without ``exercise-``::

    ddplab.hint("ping-pong")        # the hint its author wrote
    ddplab.solution("ping-pong")    # the reference solution

A hint lives in the exercise cell's metadata, ``{"ddplab": {"hint": "..."}}``;
the solution is the reference cell, between the marker lines ``BEGIN`` and
``END`` (what ``ddplab release`` replaces by a stub, ``ddplab.course.release``).

The reference notebooks are read where they are: an installed ddplab carries
them in ``ddplab/course/notebooks/`` (copied from the repository's
``notebooks/`` when the wheel is built); a checkout reads ``notebooks/``.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CourseError

# nbformat is imported where used: ``import ddplab`` stays light.

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


def exercises() -> dict[str, tuple[str, object]]:
    """Exercise name -> (notebook file name, its exercise cell), over every reference notebook."""
    import nbformat

    found: dict[str, tuple[str, object]] = {}
    for path in reference_notebooks():
        for cell in nbformat.read(path, as_version=4).cells:
            cell_id = cell.get("id", "")
            if cell_id.startswith(EXERCISE_PREFIX):
                found.setdefault(cell_id[len(EXERCISE_PREFIX):], (path.name, cell))
    return found


def _exercise(name: str):
    known = exercises()
    key = name[len(EXERCISE_PREFIX):] if name.startswith(EXERCISE_PREFIX) else name
    if key not in known:
        listing = ", ".join(f"{n} ({nb[:2]})" for n, (nb, _) in known.items())
        raise CourseError(f"ddplab: no exercise named {name!r}. The exercises (notebook) are: "
                          f"{listing}.")
    return key, known[key]


def hint_text(name: str) -> str:
    key, (notebook, cell) = _exercise(name)
    hint = cell.metadata.get("ddplab", {}).get("hint")
    if not hint:
        return (f"No hint was written for {key} ({notebook})." if solutions_removed() else
                f"No hint was written for {key} ({notebook}). "
                f"ddplab.solution({key!r}) shows the reference solution.")
    return f"Hint for {key} ({notebook}): {hint}"


def solution_text(name: str) -> str:
    """The reference exercise cell, marker lines left out, ready to paste over the stub."""
    refuse_if_removed(f"ddplab.solution({name!r})")
    key, (notebook, cell) = _exercise(name)
    body = "\n".join(line for line in cell.source.splitlines() if line.strip() not in (BEGIN, END))
    return f"# Reference solution of {key} ({notebook}):\n{body}"


def hint(name: str) -> None:
    """Print the hint for exercise ``name`` (its cell id without ``exercise-``)."""
    print(hint_text(name))


def solution(name: str) -> None:
    """Print the reference solution of exercise ``name``; try ``ddplab.hint`` first."""
    print(solution_text(name))
