"""A submission's grade is the same under each ``Isolation`` (``ddplab.grade.isolation``, issue 59
item 7): the small reference of tests/hostile/attacks.py, an honest submission and a stub, graded
in a bubblewrap sandbox, as another user (``nobody``; root only) and plainly, with the grader's
rights. Each gives the honest one its point and the stub none, with the same reasons.

As another user, the worker runs the grader's Python, which ``nobody`` may not run (this one may
live under /root, as pyenv's does): then the grader runs from the students' environment
(tests/shared_env.py), a Python every user may run with this checkout's ddplab.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nbformat
import pytest
import shared_env
from hostile import attacks

from ddplab.errors import GradeError
from ddplab.grade import class_run, sandbox, unprivileged
from ddplab.grade.isolation import Plain

pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(900)]

DESERVED = {"honest": 1, "stub": 0}
#: The grader chose this isolation itself, not for want of a sandbox.
CHOSEN = "the test chose it"
#: What must be the same under every isolation, of one ``Grade`` (JSON's types: lists, not tuples).
SUMMARY = ("lambda g: [g.student, g.score, g.error, g.cells_failed, "
           "[[m.exercise, m.passed, m.reason] for m in g.marks]]")
_what_counts = eval(SUMMARY)
#: The class graded as ``nobody`` by a grader run from another Python: argv the class folder.
AS_NOBODY = f"""
import json, sys
from pathlib import Path
from ddplab.grade import class_run, unprivileged
home = Path(sys.argv[1])
isolated = unprivileged.AnotherAccount(unprivileged.account("nobody"), {CHOSEN!r})
grades = class_run.grade([home / "submitted"], home / "course", jobs=2, cell_timeout=60,
                         isolated=isolated)
print(json.dumps([({SUMMARY})(g) for g in grades]))
"""


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


@pytest.fixture(scope="module")
def plainly(class_folder):
    """The class graded plainly: what the other isolations must give."""
    return _graded(class_folder, Plain(CHOSEN))


def _graded(home: Path, isolated) -> list[list]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(class_run.tempfile, "tempdir", str(home / "work"))
        grades = class_run.grade([home / "submitted"], home / "course", jobs=2, cell_timeout=60,
                                 isolated=isolated)
    assert list((home / "work").iterdir()) == []            # every work folder removed
    return [_what_counts(g) for g in grades]


def _graded_as_nobody(home: Path) -> list[list]:
    try:
        return _graded(home, unprivileged.AnotherAccount(unprivileged.account("nobody"), CHOSEN))
    except GradeError as e:
        if "cannot run this Python" not in str(e):
            raise
    python = shared_env.ensure().python
    done = subprocess.run([str(python), "-c", AS_NOBODY, str(home)], capture_output=True,
                          text=True, timeout=800, env=dict(os.environ, TMPDIR=str(home / "work")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert list((home / "work").iterdir()) == []
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plainly_the_honest_submission_scores_and_the_stub_does_not(plainly):
    assert {student: score for student, score, *_ in plainly} == DESERVED, plainly
    assert all(error == "" and failed == [] for _, _, error, failed, _ in plainly), plainly
    [stub_marks] = [marks for student, *_, marks in plainly if student == "stub"]
    assert stub_marks[0][2], "a failed exercise has a reason"


def test_in_a_bubblewrap_sandbox_the_grades_are_the_plain_run_s(class_folder, plainly):
    reason = sandbox.unavailable_reason()
    if reason:
        pytest.fail(f"no sandbox ({reason}); run tools/ensure_sandbox.sh")
    assert _graded(class_folder, sandbox.Bubblewrap()) == plainly


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run submissions as another user")
def test_as_another_user_the_grades_are_the_plain_run_s(class_folder, plainly):
    assert _graded_as_nobody(class_folder) == plainly
