"""``ddplab grade``: grade submitted notebooks against the reference outputs of their check cells.

    ddplab grade submitted/ --reference notebooks/ --csv grades.csv --junit grades.xml

How a submission is graded
--------------------------
1. The reference notebook (the course's own, with solutions and outputs)
   names the exercises: each check cell has id ``check-<name>`` and tag
   ``check``; its exercise cell, just above, has id ``exercise-<name>`` and tag
   ``exercise``. Cells are found by id (by tag and source when a tool lost
   the ids), never by position, so students may add cells anywhere.
2. The submission's cells run in order in a fresh kernel, except that each
   check cell runs as the *reference's* copy. A check cell the student
   deleted is put back after its exercise and runs anyway; a deleted or
   edited check cell still scores zero on its exercise.
3. An exercise passes when its exercise cell runs without error and its
   check cell runs without error and prints what the reference printed,
   compared the way nbval compares (``ddplab/nbval_sanitize.cfg`` applied to
   both sides).

Why nbclient and not ``pytest --nbval`` in a subprocess: nbval runs a
notebook in one kernel and, once a cell times out or the kernel dies, fails
every later cell. Grading must lose only the exercise that broke, so
``ddplab.grade_run`` drives the kernel with nbclient (the executor nbval's
own machinery and nbconvert share), compares with nbval's stream coalescing
and sanitize patterns, and recovers from hangs and crashes by replaying.
``pytest --nbval-lax`` stays the way to check one notebook by hand.

Isolation and parallelism
-------------------------
Each submission is graded in its own worker process (``python -m
ddplab.grade --worker``) with its own kernel; ``ddplab.start()`` in that
kernel starts a lab of its own on free ports, so submissions never share a
lab. Up to ``jobs`` workers (default: the machine's cores) run at once. A
worker that crashes or overruns its deadline costs only its own
submission, and is killed together with everything it started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
import psutil

from .grade_run import Step, difference, execute, sanitize_patterns
from .release import notebooks_in

DEFAULT_CELL_TIMEOUT = 120.0


class GradeError(ValueError):
    """The grading cannot start: a reference notebook is missing or unusable."""


@dataclass
class Mark:
    """One exercise of one submission."""
    exercise: str
    passed: bool
    reason: str = ""


@dataclass
class Grade:
    """One submission: its marks, or the error that kept it from being graded."""
    student: str
    notebook: str
    path: str
    marks: list[Mark] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    @property
    def score(self) -> int:
        return sum(mark.passed for mark in self.marks)


@dataclass
class Exercise:
    name: str
    check: dict                 # the reference check cell
    exercise: dict | None       # the reference exercise cell


def _normal(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


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
                         f"(see the README) before grading.")
    return reference, found


def load_submission(path: Path):
    """The submission as a notebook; ValueError with a one-line reason if it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the file ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"the file is damaged, ask for it again") from e
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as e:
        raise ValueError(f"valid JSON but not a notebook ({str(e).splitlines()[0]})") from e


def plan(submission, found: list[Exercise]) -> tuple[list[Step], dict[str, str]]:
    """The steps to run for a submission, and per exercise what is structurally wrong with it."""
    code = [c for c in submission.cells if c.cell_type == "code"]
    role: dict[int, tuple[str, Exercise]] = {}       # index in code -> (role, exercise)
    problems: dict[str, str] = {}
    for ex in found:
        check_id = ex.check.get("id", "")
        at = next((i for i, c in enumerate(code) if check_id and c.get("id") == check_id
                   and i not in role), None)
        if at is None:     # ids lost by a tool: the untouched check cell, by tag and source
            at = next((i for i, c in enumerate(code) if i not in role and "check" in _tags(c)
                       and _normal(c.source) == _normal(ex.check.source)), None)
        if at is None:
            problems[ex.name] = f"check cell {check_id or ex.name} was deleted"
        else:
            role[at] = ("check", ex)
            if _normal(code[at].source) != _normal(ex.check.source):
                problems[ex.name] = f"check cell {check_id} was edited"
        want = f"exercise-{ex.name}"
        mine = next((i for i, c in enumerate(code) if c.get("id") == want and i not in role), None)
        if mine is None and at is not None and at and "exercise" in _tags(code[at - 1]):
            mine = at - 1 if (at - 1) not in role else None
        if mine is None:
            problems.setdefault(ex.name, f"exercise cell {want} was deleted")
        else:
            role[mine] = ("exercise", ex)
    steps = []
    for i, cell in enumerate(code):
        kind, ex = role.get(i, ("other", None))
        source = ex.check.source if kind == "check" else cell.source
        steps.append(Step(source, kind, ex.name if ex else "", cell.get("id", ""),
                          ex.exercise.source if kind == "exercise" and ex.exercise else ""))
    _put_back_deleted_checks(steps, found)
    return steps, problems


def _put_back_deleted_checks(steps: list[Step], found: list[Exercise]) -> None:
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
        steps.insert(after + 1, Step(ex.check.source, "check", ex.name, ex.check.get("id", "")))


def score(steps: list[Step], found: list[Exercise], problems: dict[str, str],
          patterns) -> list[Mark]:
    """Per exercise: passed, or the first reason it did not."""
    marks = []
    for ex in found:
        exercise = next((s for s in steps if s.role == "exercise" and s.name == ex.name), None)
        check = next(s for s in steps if s.role == "check" and s.name == ex.name)
        outcome = (check.error if check.status != "ok" else
                   difference(ex.check.get("outputs", []), check.outputs, patterns))
        if ex.name in problems:
            ran = "it failed" if outcome else "it passed"
            why = f"{problems[ex.name]} (the reference check ran anyway: {ran})"
        elif exercise.status != "ok":
            why = f"exercise cell: {exercise.error}"
        else:
            why = f"check: {outcome}" if outcome else ""
        marks.append(Mark(ex.name, not why, why))
    return marks


def grade_one(path: Path, reference_path: Path, student: str,
              cell_timeout: float = DEFAULT_CELL_TIMEOUT) -> Grade:
    """Grade one submission in this process (a worker calls this)."""
    begin = time.monotonic()
    result = Grade(student, reference_path.stem, str(path))
    reference, found = check_reference(reference_path)
    try:
        submission = load_submission(path)
    except ValueError as e:
        result.error = f"not graded: {e}"
        result.marks = [Mark(ex.name, False, "not graded") for ex in found]
        return result
    steps, problems = plan(submission, found)
    execute(steps, str(reference_path.resolve().parent), cell_timeout)
    result.marks = score(steps, found, problems, sanitize_patterns())
    result.seconds = time.monotonic() - begin
    return result


def student_name(path: Path, reference_names: set[str]) -> str:
    """``alice`` for ``submitted/alice/01_x.ipynb`` (the course's file name) or ``alice.ipynb``."""
    if path.name in reference_names and path.parent.name not in ("", "."):
        return path.parent.name
    return path.stem


def _reference_for(path: Path, reference: Path) -> Path:
    if reference.is_file():
        return reference
    candidate = reference / path.name
    if not candidate.is_file():
        raise FileNotFoundError(f"not graded: no reference notebook named {path.name} in "
                                f"{reference}; name the reference file with --reference")
    return candidate


def grade(submissions: list[str | Path], reference: str | Path, jobs: int | None = None,
          cell_timeout: float = DEFAULT_CELL_TIMEOUT, progress=None) -> list[Grade]:
    """Grade every submission (files, or folders of them) in parallel; one Grade each, in order.

    ``progress``, if given, is called with each Grade as it finishes.
    """
    reference = Path(reference)
    if not reference.exists():
        raise GradeError(f"ddplab grade: the reference {reference} does not exist. Pass the "
                         f"course's notebooks folder (or one notebook) with --reference.")
    paths = notebooks_in([Path(s) for s in submissions]) if submissions else []
    if not paths:
        raise GradeError("ddplab grade: no submitted notebooks found. Name .ipynb files or folders.")
    names = {p.name for p in notebooks_in([reference])}
    work = []
    for path in paths:
        try:
            ref = _reference_for(path, reference)
        except FileNotFoundError as e:
            work.append((path, None, str(e)))
            continue
        check_reference(ref)               # an unusable reference stops everything, now
        work.append((path, ref, ""))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))

    def one(item) -> Grade:
        path, ref, error = item
        result = (Grade(student_name(path, names), path.stem, str(path), error=error) if ref is None
                  else _in_worker(path, ref, student_name(path, names), cell_timeout))
        if progress:
            progress(result)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, work))


def _in_worker(path: Path, ref: Path, student: str, cell_timeout: float) -> Grade:
    """Grade in a child process; a crash or overrun there costs only this submission."""
    cells = len(nbformat.read(ref, as_version=4).cells)
    deadline = 300 + 3 * cells * cell_timeout
    with tempfile.TemporaryDirectory(prefix="ddplab-grade-") as tmp:
        out = Path(tmp) / "grade.json"
        command = [sys.executable, "-m", "ddplab.grade", "--worker", str(path), str(ref), student,
                   str(cell_timeout), str(out)]
        worker = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
        begin = time.monotonic()
        try:
            _, stderr = worker.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            _kill_tree(worker.pid)
            _, stderr = worker.communicate()
            return Grade(student, ref.stem, str(path),
                         error=f"not graded: grading took longer than {deadline:g} s and was stopped")
        if worker.returncode != 0 or not out.exists():
            last = (stderr.strip().splitlines() or ["no message"])[-1]
            return Grade(student, ref.stem, str(path),
                         error=f"not graded: the grader failed ({last[:150]})")
        data = json.loads(out.read_text())
        data["marks"] = [Mark(**m) for m in data["marks"]]
        data["seconds"] = time.monotonic() - begin
        return Grade(**data)


def _kill_tree(pid: int) -> None:
    try:
        family = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for process in family:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=15)


def _worker(argv: list[str]) -> int:
    path, ref, student, cell_timeout, out = argv
    result = grade_one(Path(path), Path(ref), student, float(cell_timeout))
    Path(out).write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    sys.exit("usage: ddplab grade SUBMISSIONS... --reference NOTEBOOKS (python -m ddplab.grade "
             "is the internal worker)")
