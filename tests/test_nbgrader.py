"""The course through nbgrader itself: generate_assignment, autograde, and ddplab grade beside it.

One nbgrader course folder (in a temporary directory) holds every notebook in
notebooks/ as one assignment. ``generate_assignment`` must accept them all;
its student versions must show a student the same cells as ``ddplab
release``'s. ``autograde`` then grades (in two copies of that course folder at
once, each with its own gradebook: nbgrader runs one notebook at a time):

- "reference": four reference notebooks (``NBGRADER_REFERENCE``), each with a
  ``lab.restart()`` before every exercise section (tests/sections.py), which
  must get full marks and raise in no cell;
- "student": nbgrader's own student version of notebook 00 (``STUDENT``),
  untouched, which must get zero (every released copy's zero is proved by
  ``ddplab grade`` below: nbgrader's copies show the same cells);
- two submissions of notebook 01 from tests/test_grade.py (two exercises broken
  and three right; all stubs), which ``ddplab grade`` grades too, at the same
  time: both graders must pass and fail the same exercises (the stubs are
  notebook 01's released copy, which ``ddplab grade`` grades once, below). An
  all-right submission would be the reference again, which both already grade.

Beside it, ``ddplab grade`` makes the whole course's round trip through
ddplab's own grader: every reference notebook, with a ``lab.restart()`` before
every exercise section, must earn full marks with no cell failing
(``Grade.cells_failed``), and its ``ddplab release`` copy none. One execution
per notebook proves both that the reference passes and that every section runs
after a restart. ddplab's grader runs some checks itself against the ranks
(``ddplab.grade.witness``), so it can fail where nbgrader passes: notebook
09's reference once lost two checks that come right after a ``lab.restart()``.
nbgrader grades four of the references, not all sixteen: what it could judge
differently from ``ddplab grade`` (its metadata, its locked cells, its executor)
is the same in every notebook, and each notebook's run costs a lab. The four
cover the course's kinds of notebook: 00 (one rank), 01 (``%%rank`` cells and a
deadlock shown on purpose), 05 (sections rerun from an earlier cell after a
restart, ``RESTART_FROM``) and 14 (a build-it chapter).

nbgrader executes each notebook in a kernel, as ``ddplab grade`` does; a lab
start per notebook on a shared 2-core machine is why the timeouts are long.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from sections import failures, restart_points, with_restarts
from test_grade import EXERCISES, _cell, _replace, _solutions_into_stubs

from ddplab import procs
from ddplab.course.release import output_digest, release_notebook
from ddplab.grade.class_run import grade

# nbgrader itself: minutes.
pytestmark = [pytest.mark.slow, pytest.mark.course]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ASSIGNMENT = "course"
CELL_TIMEOUT = 900
NAME01 = "01_point_to_point.ipynb"
#: nbgrader's own student versions graded by nbgrader: one notebook, not the course (each
#: notebook run costs a lab; ddplab grade runs every released copy, and the copies are the same).
STUDENT = ["00_setup.ipynb"]
#: The references nbgrader autogrades (with their restarts): see the module's docstring.
NBGRADER_REFERENCE = ["00_setup.ipynb", NAME01, "05_ddp_training.ipynb",
                      "14_long_sequences_and_experts.ipynb"]


def _nbgrader(course: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    # nbgrader runs its database migrations with the `alembic` command: the venv's bin on PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "nbgrader", *args, ASSIGNMENT, "--force"],
                          cwd=course, env=env, capture_output=True, text=True, timeout=timeout)


def _cells_seen(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """An nbgrader course folder whose one assignment is the course; generate_assignment run."""
    course = tmp_path_factory.mktemp("nbgrader")
    (course / "source" / ASSIGNMENT).mkdir(parents=True)
    for path in NOTEBOOKS:
        shutil.copyfile(path, course / "source" / ASSIGNMENT / path.name)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        "c.CourseDirectory.course_id = 'ddplab'\n"
        f"c.Execute.timeout = {CELL_TIMEOUT}\n"
        # the student version's outputs as ddplab release makes them (docs/instructors.md)
        "from ddplab.course.nbgrader_release import PREPROCESSORS\n"
        "c.GenerateAssignment.preprocessors = PREPROCESSORS\n")
    begin = time.monotonic()
    result = _nbgrader(course, "generate_assignment", timeout=900)
    seconds = time.monotonic() - begin
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    return course, seconds


def test_generate_assignment_accepts_every_notebook(course, record_property):
    course, seconds = course
    record_property("generate_assignment_s", round(seconds, 1))
    released = sorted(p.name for p in (course / "release" / ASSIGNMENT).glob("*.ipynb"))
    assert released == [p.name for p in NOTEBOOKS]
    for name in released:
        assert "BEGIN SOLUTION" not in (course / "release" / ASSIGNMENT / name).read_text(), name


def test_ddplab_release_shows_the_student_what_nbgrader_shows(course):
    """Same cells, same sources (stubs included), same outputs and execution counts: nbgrader,
    configured with ddplab.course.nbgrader_release, keeps the outputs ddplab release keeps."""
    course, _ = course
    for path in NOTEBOOKS:
        ours = release_notebook(nbformat.read(path, as_version=4), path.name)
        theirs = nbformat.read(course / "release" / ASSIGNMENT / path.name, as_version=4)
        assert _cells_seen(ours) == _cells_seen(theirs), path.name
        assert [c.get("id") for c in ours.cells] == [c.get("id") for c in theirs.cells], path.name
        assert [(c.get("outputs"), c.get("execution_count")) for c in ours.cells] == \
            [(c.get("outputs"), c.get("execution_count")) for c in theirs.cells], path.name
        assert any(c.get("outputs") for c in theirs.cells), f"{path.name}: nbgrader cleared them all"


def _agreement_submissions() -> dict[str, nbformat.NotebookNode]:
    """Two of tests/test_grade.py's submissions of notebook 01 that both graders can judge
    alike (its deleted and edited check cells are not among them: nbgrader puts a locked
    cell's source back, by design, where ddplab grade scores that exercise zero)."""
    reference = nbformat.read(ROOT / "notebooks" / NAME01, as_version=4)
    released = release_notebook(reference)
    broken = _solutions_into_stubs(nbformat.from_dict(released), reference)
    _replace(broken, "exercise-swap", "return received", "return t")               # wrong result
    _replace(broken, "exercise-ring-token", "left, right = (rank - 1)",            # an exception
             "left, right = undefined_name + (rank - 1)")
    assert _cell(broken, "check-swap")
    return {"agree-broken": broken, "agree-stubs": released}


def _restarted(name: str) -> nbformat.NotebookNode:
    """Reference notebook ``name`` with a ``lab.restart()`` before every exercise section."""
    return with_restarts(nbformat.read(ROOT / "notebooks" / name, as_version=4), name)


def _shards(course: Path, agreement) -> list[dict[str, dict]]:
    """The submissions nbgrader grades, split over two course folders autograded at once:
    student -> notebook name -> notebook (or the file to copy). nbgrader grades one notebook
    at a time, and the reference with its restarts is most of the run; its notebooks
    alternate between the two, the other students' go to the second."""
    shards: list[dict] = [{"reference": {}}, {"reference": {}, "student": {}}]
    for i, name in enumerate(NBGRADER_REFERENCE):
        shards[i % 2]["reference"][name] = _restarted(name)
    for name in STUDENT:          # nbgrader's own student versions, untouched
        shards[1]["student"][name] = course / "release" / ASSIGNMENT / name
    for student, nb in agreement.items():
        shards[1][student] = {NAME01: nb}
    return shards


@pytest.fixture(scope="module")
def autograded(course, tmp_path_factory):
    """nbgrader autograde over every submission (two course folders at once), with ddplab
    grade running beside it."""
    from nbgrader.api import Gradebook

    course, _ = course
    agreement = _agreement_submissions()
    shards = _shards(course, agreement)
    folders = []
    for i, shard in enumerate(shards):
        # A copy of the course after generate_assignment: its release, its gradebook.
        folder = course.parent / f"{course.name}-autograde{i}"
        shutil.copytree(course, folder)
        for student, notebooks in shard.items():
            (folder / "submitted" / student / ASSIGNMENT).mkdir(parents=True)
            for name, nb in notebooks.items():
                to = folder / "submitted" / student / ASSIGNMENT / name
                shutil.copyfile(nb, to) if isinstance(nb, Path) else nbformat.write(nb, to)
        folders.append(folder)

    ours_root = tmp_path_factory.mktemp("ddplab-grade")
    ddplab_paths = []
    for student in ("course-reference", "course-released"):
        (ours_root / student).mkdir()
        ddplab_paths.append(ours_root / student)
    for path in NOTEBOOKS:
        reference = nbformat.read(path, as_version=4)
        nbformat.write(_restarted(path.name), ours_root / "course-reference" / path.name)
        nbformat.write(release_notebook(reference, path.name), ours_root / "course-released" / path.name)
    # "agree-stubs" is notebook 01's released copy, byte for byte: ddplab grade grades it
    # once, as course-released, and both graders' marks for it are compared below.
    assert nbformat.writes(agreement["agree-stubs"]).strip() == \
        (ours_root / "course-released" / NAME01).read_text().strip()
    for student, nb in agreement.items():
        if student != "agree-stubs":
            (ours_root / student).mkdir()
            nbformat.write(nb, ours_root / student / NAME01)
            ddplab_paths.append(ours_root / student / NAME01)

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    begin = time.monotonic()
    # Logs to files: a pipe nobody reads while ddplab grades would stall nbgrader once full.
    log_paths = [folder.parent / f"{folder.name}.log" for folder in folders]
    runs = []
    try:
        for folder, log_path in zip(folders, log_paths):
            with open(log_path, "w") as log_file:
                runs.append(subprocess.Popen([sys.executable, "-m", "nbgrader", "autograde",
                                              ASSIGNMENT, "--force"], cwd=folder, env=env,
                                             stdout=log_file, stderr=subprocess.STDOUT))
        # Two at once: one run alone keeps about half a core busy (it waits on its ranks).
        ours = {(g.student, g.notebook): g for g in grade(ddplab_paths, ROOT / "notebooks", jobs=2,
                                                          cell_timeout=300)}
        ddplab_seconds = time.monotonic() - begin
        for run in runs:
            run.wait(timeout=3000)
    finally:
        for run in runs:
            procs.end_tree(run, grace=5)
            run.wait()
    nbgrader_seconds = time.monotonic() - begin
    logs = [log_path.read_text() for log_path in log_paths]
    for run, log in zip(runs, logs):
        assert run.returncode == 0, log[-8000:]
    ours["agree-stubs", Path(NAME01).stem] = ours["course-released", Path(NAME01).stem]
    scores, executed = {}, {}
    for folder, shard in zip(folders, shards):
        with Gradebook(f"sqlite:///{folder / 'gradebook.db'}") as gradebook:
            for student, notebooks in shard.items():     # a notebook not handed in scores 0 there
                for name in notebooks:
                    notebook = gradebook.find_submission_notebook(Path(name).stem, ASSIGNMENT, student)
                    scores[student, Path(name).stem] = (notebook.score, notebook.max_score,
                                                        {g.name: g.score for g in notebook.grades})
        for name in shard["reference"]:
            executed[name] = nbformat.read(folder / "autograded" / "reference" / ASSIGNMENT / name,
                                           as_version=4)
    ran = sum(len(list((f / "autograded").glob(f"*/{ASSIGNMENT}/*.ipynb"))) for f in folders)
    print(f"nbgrader autograde: {ran} notebooks in {nbgrader_seconds:.0f} s; "
          f"ddplab grade beside it: {len(ours) - 1} in {ddplab_seconds:.0f} s")
    return scores, ours, nbgrader_seconds, "\n".join(logs), executed


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_autograde_gives_the_reference_full_marks_and_the_student_version_zero(autograded,
                                                                            record_property):
    scores, _, seconds, log, _ = autograded
    record_property("autograde_s", round(seconds, 1))
    for name in NBGRADER_REFERENCE:
        path = ROOT / "notebooks" / name
        score, out_of, _ = scores["reference", path.stem]
        assert score == out_of, f"reference {path.name}: {score}/{out_of}: {scores['reference', path.stem]}"
        checks = sum(c.get("id", "").startswith("check-")
                     for c in nbformat.read(path, as_version=4).cells)
        assert out_of == checks, f"{path.name}: nbgrader counts {out_of} points, {checks} checks"
    for name in STUDENT:
        score, out_of, cells = scores["student", Path(name).stem]
        assert score == 0, f"student version of {name} scored {score}/{out_of}: {cells}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_section_runs_after_a_restart(autograded, path):
    """Every reference ran under ddplab grade with a lab.restart() before each exercise
    section: no cell failed (its full marks are the next tests'). nbgrader's copies of
    NBGRADER_REFERENCE ran the same, and no cell of theirs raised either."""
    _, ours, _, _, executed = autograded
    points = restart_points(path.name, nbformat.read(path, as_version=4).cells)
    graded = nbformat.read(Path(ours["course-reference", path.stem].path), as_version=4)
    restarts = [c for c in graded.cells if c.metadata.get("ddplab", {}).get("restart_before")]
    assert len(restarts) == len(points), f"{path.name}: {len(restarts)} restarts, {len(points)} planned"
    failed = ours["course-reference", path.stem].cells_failed
    assert not failed, f"{path.name}: after lab.restart():\n" + "\n".join(failed[:3])
    if path.name in executed:
        ran = [c for c in executed[path.name].cells
               if c.metadata.get("ddplab", {}).get("restart_before")]
        assert all(c.get("outputs") is not None and c.get("execution_count") for c in ran), \
            f"{path.name}: a restart cell was never executed by nbgrader"
        broken = failures(executed[path.name])
        more = f"\n... and {len(broken) - 3} more cells" if len(broken) > 3 else ""
        assert not broken, f"{path.name}: under nbgrader, after lab.restart():\n" + \
            "\n".join(broken[:3]) + more


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_ddplab_grade_and_nbgrader_agree_on_the_same_submissions(autograded):
    scores, ours, _, _, _ = autograded
    expected_lost = {"agree-broken": {"swap", "ring-token"},
                     "agree-stubs": set(EXERCISES)}
    for student, lost in expected_lost.items():
        _, _, cells = scores[student, Path(NAME01).stem]
        by_nbgrader = {name.removeprefix("check-"): score == 1 for name, score in cells.items()}
        by_ddplab = {m.exercise: m.passed for m in ours[student, Path(NAME01).stem].marks}
        assert by_nbgrader == by_ddplab, f"{student}: nbgrader {by_nbgrader}, ddplab {by_ddplab}"
        assert {name for name, ok in by_ddplab.items() if not ok} == lost, student


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_ddplab_grade_gives_the_reference_full_marks(autograded, path):
    _, ours, _, _, _ = autograded
    result = ours["course-reference", path.stem]
    checks = sum(c.get("id", "").startswith("check-")
                 for c in nbformat.read(path, as_version=4).cells)
    failed = {m.exercise: m.reason for m in result.marks if not m.passed}
    assert not result.error and not failed, f"{path.name}: {result.error} {failed}"
    assert len(result.marks) == checks, f"{path.name}: {len(result.marks)} marks, {checks} checks"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_output_a_released_copy_keeps_is_one_its_stub_run_prints(autograded, path):
    """Issue 53: the student copy holds no output its own run would not print. Its run is the
    round trip's ``ddplab grade`` of the released copy (every solution a stub), no extra
    execution: each cell that keeps outputs must have printed the same there (``digest``, as
    nbval compares), and no stub may have broken the lab (a replay would go on from the
    reference solution, not from what the student's run leaves)."""
    _, ours, _, _, _ = autograded
    result = ours["course-released", path.stem]
    broke = [f for f in result.cells_failed if ": timeout: " in f or ": died: " in f or "not run" in f]
    broke += [m.reason for m in result.marks if "HangError" in m.reason or "timed out" in m.reason
              or "kernel died" in m.reason or "not run" in m.reason]
    assert not broke, f"{path.name}: a stub broke the lab: {broke[:2]}"
    released = release_notebook(nbformat.read(path, as_version=4), path.name)
    kept = [cell for cell in released.cells if cell.cell_type == "code" and cell.outputs]
    differ = [cell.id for cell in kept if result.cell_digests.get(cell.id) != output_digest(cell)]
    assert not differ, (f"{path.name}: the student copy keeps outputs its stub run printed otherwise: "
                        f"{differ}; run tools/clean_notebook.py --stub-run {path}")
    assert "Correct" not in nbformat.writes(released)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_ddplab_grade_gives_the_released_copy_zero(autograded, path):
    _, ours, _, _, _ = autograded
    result = ours["course-released", path.stem]
    passed = [m.exercise for m in result.marks if m.passed]
    assert not result.error and result.marks and not passed, f"{path.name}: {result.error} {passed}"
