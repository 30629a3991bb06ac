"""A submission's grade is the same under each ``Isolation`` (``ddplab.grade.isolation``, issue 59
item 7): the small reference of tests/hostile/attacks.py, an honest submission and a stub, graded
in a bubblewrap sandbox, as another user (``nobody``; root only) and plainly, with the grader's
rights. Each gives the honest one its point and the stub none, with the same reasons."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest
from hostile import attacks

from ddplab.errors import GradeError
from ddplab.grade import class_run, sandbox, unprivileged
from ddplab.grade.isolation import Plain

pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(900)]

DESERVED = {"honest": 1, "stub": 0}
#: The grader chose this isolation itself, not for want of a sandbox.
CHOSEN = "the test chose it"


@pytest.fixture(scope="module")
def class_folder():
    """The reference and the two submissions, in a folder every user may enter (the work folders
    of the grading run, handed to ``nobody``, are made in it too), removed at the end."""
    home = Path(tempfile.mkdtemp(prefix="ddplab-isolation-", dir="/tmp"))
    try:
        home.chmod(0o755)
        (home / "course").mkdir()
        nbformat.write(attacks.reference(), home / "course" / "00_setup.ipynb")
        for name in DESERVED:
            (home / "submitted" / name).mkdir(parents=True)
            (home / "submitted" / name / "00_setup.ipynb").write_text(attacks.submission(
                name, marker="unused", reference="/nowhere", other="/nowhere", csv="/nowhere"))
        (home / "work").mkdir(mode=0o755)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _isolation(kind: str):
    if kind == "bubblewrap":
        reason = sandbox.unavailable_reason()
        if reason:
            pytest.fail(f"no sandbox ({reason}); run tools/ensure_sandbox.sh")
        return sandbox.Bubblewrap()
    if kind == "another account":
        if os.geteuid() != 0:
            pytest.skip("needs root, to run submissions as another user")
        try:
            return unprivileged.AnotherAccount(unprivileged.account("nobody"), CHOSEN)
        except GradeError as e:      # this Python out of nobody's reach: test_autograder covers it
            pytest.skip(str(e))
    return Plain(CHOSEN)


def _what_counts(grade: class_run.Grade) -> tuple:
    return (grade.student, grade.score, grade.error, grade.cells_failed,
            [(m.exercise, m.passed, m.reason) for m in grade.marks])


@pytest.fixture(scope="module")
def plainly(class_folder):
    """The class graded plainly: what the other isolations must give."""
    return _graded(class_folder, Plain(CHOSEN))


def _graded(home: Path, isolated) -> list[tuple]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(class_run.tempfile, "tempdir", str(home / "work"))
        grades = class_run.grade([home / "submitted"], home / "course", jobs=2, cell_timeout=60,
                                 isolated=isolated)
    assert list((home / "work").iterdir()) == []            # every work folder removed
    return [_what_counts(g) for g in grades]


def test_plainly_the_honest_submission_scores_and_the_stub_does_not(plainly):
    assert {student: score for student, score, *_ in plainly} == DESERVED, plainly
    assert all(error == "" and failed == [] for _, _, error, failed, _ in plainly), plainly
    [stub_marks] = [marks for student, *_, marks in plainly if student == "stub"]
    assert stub_marks[0][2], "a failed exercise has a reason"


@pytest.mark.parametrize("kind", ["bubblewrap", "another account"])
def test_each_isolation_grades_as_the_plain_run(class_folder, plainly, kind):
    assert _graded(class_folder, _isolation(kind)) == plainly
