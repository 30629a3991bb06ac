"""Which cells of a submission are its exercises and checks, and what to run.

The reference notebook names the exercises: each check cell has id
``check-<name>`` and tag ``check``; its exercise cell, just above, has id
``exercise-<name>`` and tag ``exercise``. A submission's cells are matched to
them by id, never by position. Some editors strip ids and tags (or give new
ids): then a check cell is the cell whose source is the reference check's
(the check call itself), and its exercise the nearest cell above it that
holds the reference exercise's own lines, those outside its solution block
(``%%ranks --timeout 15``, ``def my_ring(...):``), or, where it has none,
the cell just above. A check cell found by none of these was deleted.
``plan`` lists the cells to run, the reference's copy in place of each check
cell, a deleted check cell put back after its exercise, as ``CellRun``s that
``ddplab.grade.run`` runs and ``ddplab.grade.compare`` scores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ..errors import GradeError
from .nbval_rules import find_comment_markers


@dataclass
class CellRun:
    """One cell to run, and what came of it."""
    source: str
    role: str = "other"          # "exercise", "check" or "other"
    name: str = ""               # the exercise, for exercise and check steps
    cell_id: str = ""
    reference_source: str = ""   # exercise steps: the reference solution, used when replaying
    expect_error: bool = False   # tagged raises-exception: an error here is the lesson, not a failure
    skip: bool = False           # marked NBVAL_SKIP / tagged nbval-skip: nbval does not run it
    status: str = "pending"      # ok, error, timeout, died, not run
    error: str = ""              # a short reason when status is not ok
    outputs: list = field(default_factory=list)
    seconds: float = 0.0         # how long it ran (its last run, when replayed)


def describe(step: CellRun) -> str:
    return f"cell {step.cell_id}" if step.cell_id else "a cell"


@dataclass
class Exercise:
    name: str
    check: dict                 # the reference check cell
    exercise: dict | None       # the reference exercise cell


def _normal(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def _nbval_option(cell, option: str, tag: str) -> bool:
    """Whether a cell asks nbval for ``option`` by comment (``# NBVAL_SKIP``) or by tag.

    The grader honours what nbval honours: skipped cells do not run, and an
    error in a cell that expects one (``raises-exception``) is the lesson.
    """
    return bool(dict(find_comment_markers(cell.source)).get(option)) or tag in _tags(cell)


def exercises(reference) -> list[Exercise]:
    """The exercises of a reference notebook, in order, from its check cells."""
    code = [c for c in reference.cells if c.cell_type == "code"]
    found = []
    for index, cell in enumerate(code):
        cell_id = cell.get("id", "")
        if not (cell_id.startswith("check-") or "check" in _tags(cell)):
            continue
        name = cell_id.removeprefix("check-") or f"check{len(found) + 1}"
        exercise = next((c for c in code if c.get("id") == f"exercise-{name}"), None)
        if exercise is None and index and "exercise" in _tags(code[index - 1]):
            exercise = code[index - 1]
        found.append(Exercise(name, cell, exercise))
    return found


def check_reference(path: Path):
    """The reference notebook and its exercises; GradeError if it cannot grade anything."""
    try:
        reference = nbformat.read(path, as_version=4)
    except Exception as e:
        raise GradeError(f"ddplab grade: cannot read the reference {path}: {e}. "
                         f"Use the course's own notebook, executed, as the reference.") from e
    found = exercises(reference)
    if not found:
        raise GradeError(f"ddplab grade: the reference {path} has no check cells. Give each "
                         f"check cell the id check-<name> and the tag 'check'.")
    bare = [e.name for e in found if not e.check.get("outputs")]
    if bare:
        raise GradeError(f"ddplab grade: check cell check-{bare[0]} in {path} has no stored "
                         f"output to compare with. Execute and clean the reference notebook "
                         f"(see docs/contributing.md, \"Editing a notebook\") before grading.")
    return reference, found


def notebooks_in(paths: list[str | Path]) -> list[Path]:
    """The ``.ipynb`` files named, and those inside named folders (sorted, no checkpoints)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.suffix == ".ipynb" and path.is_file():
            found.append(path)
        elif not path.exists():
            raise FileNotFoundError(f"ddplab: {path} does not exist. Check the path, and name "
                                    f"notebooks (.ipynb) or folders that hold them.")
        else:
            raise FileNotFoundError(f"ddplab: {path} is neither a notebook (.ipynb) nor a folder. "
                                    f"Name notebooks or folders that hold them.")
    return found


def load_submission(text: str):
    """The submission's text (``handin.read_text``) as a notebook; ValueError with a one-line reason if
    it is not one."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"the file is damaged, ask for it again") from e
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as e:
        raise ValueError(f"valid JSON but not a notebook ({str(e).splitlines()[0]})") from e


def plan(submission, found: list[Exercise], reference=None) -> tuple[list[CellRun], dict[str, str]]:
    """The steps to run for a submission, and per exercise what is structurally wrong with it.

    ``reference``: the reference notebook; a submission that lost its ids and tags takes the
    nbval tags (``raises-exception``, ``nbval-skip``) of the reference cell with its source.
    """
    code = [c for c in submission.cells if c.cell_type == "code"]
    role: dict[int, tuple[str, Exercise]] = {}       # index in code -> (role, exercise)
    problems: dict[str, str] = {}
    lost_ids = not any(str(c.get("id", "")).startswith(("exercise-", "check-")) for c in code)
    for ex in found:
        check_id = ex.check.get("id", "")
        at = next((i for i, c in enumerate(code) if check_id and c.get("id") == check_id
                   and i not in role), None)
        if at is None:     # ids lost by a tool: the untouched check cell, by tag and source
            at = next((i for i, c in enumerate(code) if i not in role and "check" in _tags(c)
                       and _normal(c.source) == _normal(ex.check.source)), None)
        if at is None:     # ids and tags lost: by its source alone (the check call)
            at = next((i for i, c in enumerate(code) if i not in role
                       and _normal(c.source) == _normal(ex.check.source)), None)
        if at is None:
            problems[ex.name] = (f"check cell {check_id or ex.name} was deleted (no cell has its "
                                 f"id, its tag or its source)")
        else:
            role[at] = ("check", ex)
            if _normal(code[at].source) != _normal(ex.check.source):
                problems[ex.name] = f"check cell {check_id} was edited"
        want = f"exercise-{ex.name}"
        mine = next((i for i, c in enumerate(code) if c.get("id") == want and i not in role), None)
        if mine is None and at is not None and at and "exercise" in _tags(code[at - 1]):
            mine = at - 1 if (at - 1) not in role else None
        if mine is None and at is not None and lost_ids:
            mine = _exercise_above(code, at, ex, role)
        if mine is None:
            problems.setdefault(ex.name, f"exercise cell {want} was deleted")
        else:
            role[mine] = ("exercise", ex)
            if at is not None and mine > at:
                # Run where it is, it checks nothing yet: the reference check is
                # put back after the exercise, as for a deleted one.
                del role[at]
                problems[ex.name] = (f"check cell {check_id or ex.name} was moved above its "
                                     f"exercise cell {want}; keep it below")
    tagged = ({_normal(c.source): c for c in reference.cells if c.cell_type == "code"}
              if lost_ids and reference is not None else {})
    steps = []
    for i, cell in enumerate(code):
        kind, ex = role.get(i, ("other", None))
        source = ex.check.source if kind == "check" else cell.source
        marked = tagged.get(_normal(cell.source), cell)
        steps.append(CellRun(source, kind, ex.name if ex else "", cell.get("id", ""),
                          ex.exercise.source if kind == "exercise" and ex.exercise else "",
                          expect_error=_nbval_option(marked, "check_exception", "raises-exception"),
                          skip=kind == "other" and _nbval_option(marked, "skip", "nbval-skip")))
    _put_back_deleted_checks(steps, found)
    return steps, problems


def _own_lines(source: str) -> set[str]:
    """The lines of a reference exercise outside its solution block, that a student's copy keeps
    (``%%ranks --timeout 15``, ``def my_ring(tensor):``): not blank, not comments."""
    lines, inside = set(), False
    for line in source.splitlines():
        line = line.strip()
        if line.startswith("### BEGIN SOLUTION") or line.startswith("### END SOLUTION"):
            inside = line.startswith("### BEGIN")
        elif line and not inside and not line.startswith("#"):
            lines.add(line)
    return lines


def _exercise_above(code: list, at: int, ex: Exercise, role: dict) -> int | None:
    """The exercise cell of check cell ``code[at]`` in a notebook without ids and tags: the
    nearest cell above it (not past another check) holding the reference exercise's own lines;
    where the exercise has none, the cell just above."""
    own = _own_lines(ex.exercise.source) if ex.exercise is not None else set()
    for i in range(at - 1, -1, -1):
        if role.get(i, ("",))[0] == "check":
            return None
        if i in role:
            continue
        if not own or own <= {line.strip() for line in code[i].source.splitlines()}:
            return i
    return None


def _put_back_deleted_checks(steps: list[CellRun], found: list[Exercise]) -> None:
    present = {s.name for s in steps if s.role == "check"}
    for ex in found:
        if ex.name in present:
            continue
        after = next((i for i, s in enumerate(steps)
                      if s.role == "exercise" and s.name == ex.name), None)
        if after is None:    # the exercise went too: after the check before it, or at the end
            earlier = [i for i, s in enumerate(steps) if s.role == "check"
                       and [e.name for e in found].index(s.name) < found.index(ex)]
            after = earlier[-1] if earlier else len(steps) - 1
        steps.insert(after + 1, CellRun(ex.check.source, "check", ex.name, ex.check.get("id", "")))
