"""Grades for Gradescope (results.json) and for an LMS gradebook (Canvas's CSV import)."""

import csv
import io
import json
import subprocess
import sys

import pytest
from conftest import tiny_course

from ddplab.grade import report
from ddplab.grade.class_run import Grade
from ddplab.grade.compare import Mark

CLASS = [
    Grade("alice", "01_p2p", "a.ipynb", marks=[Mark("ping", True, ""), Mark("swap", True, "")]),
    Grade("bob", "01_p2p", "b.ipynb",
          marks=[Mark("ping", True, "", "Correct: ping pong."),
                 Mark("swap", False, "check: swap is wrong on rank 1.\n  rank 1: got 2   <-- wrong\n"
                                     "Hint: swap them.")]),
    Grade("bob", "02_coll", "c.ipynb", error="not graded: not valid JSON"),
]


def test_gradescope_has_a_test_per_exercise_with_the_reason_the_student_may_see():
    results = json.loads(report.to_gradescope(CLASS[1:]))
    assert results["score"] == 1 and results["stdout_visibility"] == "hidden"
    assert [(t["name"], t["score"], t["max_score"]) for t in results["tests"]] == [
        ("01_p2p: ping", 1, 1), ("01_p2p: swap", 0, 1), ("02_coll: not graded", 0, 1)]
    # what the student saw in the notebook: the check's whole feedback, and a pass's own line
    assert results["tests"][1]["output"] == ("check: swap is wrong on rank 1.\n  rank 1: got 2   <-- wrong\n"
                                             "Hint: swap them.")
    assert results["tests"][0]["output"] == "Correct: ping pong."
    assert results["tests"][2]["output"] == "not graded: not valid JSON"


def test_canvas_csv_has_the_identity_columns_points_possible_and_a_row_per_student():
    rows = list(csv.reader(io.StringIO(report.to_canvas(CLASS))))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_p2p", "02_coll"]
    assert rows[1] == ["Points Possible", "", "", "", "", "2", "0"]
    assert rows[2:] == [["alice", "", "", "alice", "", "2", ""], ["bob", "", "", "bob", "", "1", "0"]]


def _grade(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddplab", "grade", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow               # it grades: a kernel per submission
def test_the_command_writes_gradescopes_results_and_canvas_csv(tmp_path):
    reference, submitted = tiny_course(tmp_path, "x = 2")
    result = _grade(str(submitted / "mallory"), "--reference", str(reference),
                    "--gradescope", str(tmp_path / "results.json"), "--canvas", str(tmp_path / "canvas.csv"))
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(t["name"], t["score"]) for t in results["tests"]] == [("loud: loud", 1)]
    assert "mallory" in (tmp_path / "canvas.csv").read_text()


def test_gradescope_refuses_a_class_and_two_outputs_naming_one_file(tmp_path):
    reference, submitted = tiny_course(tmp_path, "x = 2")
    (submitted / "trudy").mkdir()
    (submitted / "trudy" / "loud.ipynb").write_text((submitted / "mallory" / "loud.ipynb").read_text())
    result = _grade(str(submitted), "--reference", str(reference), "--gradescope", str(tmp_path / "r.json"))
    assert result.returncode == 2 and "the work of 2 students (mallory, trudy" in result.stderr
    result = _grade(str(submitted / "mallory"), "--reference", str(reference),
                    "--canvas", str(tmp_path / "g.csv"), "--csv", str(tmp_path / "g.csv"))
    assert result.returncode == 2 and "--csv and --canvas both name" in result.stderr
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "g.csv").exists()
