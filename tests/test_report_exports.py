"""Grades for Gradescope (results.json) and for an LMS gradebook (Canvas's CSV import)."""

import csv
import io
import json
import re
import subprocess
import sys
from xml.etree import ElementTree as ET

import pytest
from conftest import tiny_course

from ddplab.errors import GradeError
from ddplab.grade import report
from ddplab.grade.class_run import Grade
from ddplab.grade.compare import Mark

CLASS = [
    Grade("alice", "01_p2p", "a.ipynb", marks=[Mark("ping", True, ""), Mark("swap", True, "")]),
    Grade("bob", "01_p2p", "b.ipynb",
          marks=[Mark("ping", True, "", output="Correct: ping pong."),
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


def _csv(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def test_a_cell_a_spreadsheet_would_run_is_written_as_text():
    # a student folder named "=cmd|calc" was written as is into Student and SIS Login ID (issue 58)
    hostile = [Grade("=cmd|' /C calc'!A0", "01_p2p", "x.ipynb", section="@SUM(A1)",
                     marks=[Mark("ping", False, "-1 is wrong on rank 1"), Mark("swap", True, "")]),
               Grade("+tab", "01_p2p", "y.ipynb", error="\tnot graded: injected")]
    canvas = _csv(report.to_canvas(hostile))
    assert canvas[2][:5] == ["'=cmd|' /C calc'!A0", "", "", "'=cmd|' /C calc'!A0", "'@SUM(A1)"]
    assert canvas[3][0] == canvas[3][3] == "'+tab" and canvas[2][5] == "1"     # numbers stay numbers
    rows = {row[0]: row for row in _csv(report.to_csv(hostile))[1:]}
    head = _csv(report.to_csv(hostile))[0]
    assert rows["'=cmd|' /C calc'!A0"][head.index("reasons")] == "ping: -1 is wrong on rank 1"
    assert rows["'=cmd|' /C calc'!A0"][head.index("section")] == "'@SUM(A1)"
    assert rows["'+tab"][head.index("error")] == "'\tnot graded: injected"
    for row in canvas + _csv(report.to_csv(hostile)):
        assert not any(cell.startswith(("=", "+", "-", "@", "\t", "\r")) for cell in row), row


# Two students named alice, in two sections; the first handed in 01 twice (graded: the newest).
SECTIONS = [
    Grade("alice", "01_p2p", "sec1/alice/late/01_p2p.ipynb", section="sec1",
          copies=["sec1/alice/01_p2p.ipynb (an older copy)"],
          marks=[Mark("ping", True, "", 1.5), Mark("swap", True, "", 4.0)], seconds=9.0),
    Grade("alice", "01_p2p", "sec2/alice/01_p2p.ipynb", section="sec2",
          marks=[Mark("ping", False, "check: ping is wrong", 2.0), Mark("swap", True, "", 3.0)]),
]


def test_every_export_keeps_two_students_of_one_name_and_a_second_copy_never_zeroes():
    table = report.table(SECTIONS)
    assert [line.split()[:3] for line in table.splitlines()[1:3]] == [
        ["sec1/alice", "01_p2p", "2/2"], ["sec2/alice", "01_p2p", "1/2"]]
    assert ("sec1/alice  01_p2p: graded sec1/alice/late/01_p2p.ipynb, the newest of 2 copies; "
            "not graded: sec1/alice/01_p2p.ipynb (an older copy)") in table
    head, *rows = _csv(report.to_csv(SECTIONS))
    assert [(r[0], r[head.index("section")], r[head.index("score")]) for r in rows] == [
        ("alice", "sec1", "2"), ("alice", "sec2", "1")]
    assert "an older copy" in rows[0][head.index("copies")] and rows[1][head.index("copies")] == ""
    canvas = _csv(report.to_canvas(SECTIONS))
    assert [(r[0], r[3], r[4], r[5]) for r in canvas[2:]] == [("alice", "alice", "sec1", "2"),
                                                              ("alice", "alice", "sec2", "1")]
    cases = ET.fromstring(report.to_junit(SECTIONS)).iter("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("01_p2p.sec1/alice", "ping"), ("01_p2p.sec1/alice", "swap"),
        ("01_p2p.sec2/alice", "ping"), ("01_p2p.sec2/alice", "swap")]
    results = json.loads(report.to_gradescope(SECTIONS[:1]))
    assert results["score"] == 2 and len(results["tests"]) == 2          # the copy is not a test
    assert "sec1/alice/01_p2p.ipynb (an older copy)" in results["output"]


def test_junit_gives_each_exercise_its_own_time():
    cases = list(ET.fromstring(report.to_junit(SECTIONS)).iter("testcase"))
    assert [c.get("time") for c in cases] == ["1.5", "4.0", "2.0", "3.0"]     # was 4.5 for both


CANVAS_EXPORT = """\ufeffStudent,ID,SIS User ID,SIS Login ID,Integration ID,Section,Quiz 1 (311)
    Points Possible,,,,,,10
"Liddell, Alice",1001,S-17,alice@uni.example,,Sec 1,9
"Builder, Bob",1002,S-18,bob,,Sec 2,7
"Liddell, Alicia",1003,S-19,alice@other.example,,Sec 2,8
"""


def test_a_roster_fills_canvas_ids_and_names_whom_it_cannot_match(tmp_path):
    from ddplab.grade.gradebook import Roster, roster_warnings

    (tmp_path / "roster.csv").write_text(CANVAS_EXPORT)
    roster = Roster.read(tmp_path / "roster.csv")
    grades = [Grade("s-17", "01_p2p", "a.ipynb", marks=[Mark("ping", True, "")]),
              Grade("bob", "01_p2p", "b.ipynb", marks=[Mark("ping", False, "x")]),
              Grade("alice", "01_p2p", "c.ipynb", marks=[Mark("ping", True, "")]),   # two alice@
              Grade("zed", "01_p2p", "d.ipynb", error="not graded: not valid JSON")]
    rows = _csv(report.to_canvas(grades, roster))
    assert rows[2:] == [["Liddell, Alice", "1001", "S-17", "alice@uni.example", "Sec 1", "1"],
                        ["Builder, Bob", "1002", "S-18", "bob", "Sec 2", "0"],
                        ["alice", "", "", "alice", "", "1"],
                        ["zed", "", "", "zed", "", "0"]]
    said = roster_warnings(grades, roster)
    assert [line.split()[0] for line in said] == ["alice", "zed"]
    assert all("is not in the roster" in line for line in said)
    (tmp_path / "bad.csv").write_text("Name,Login\nAlice,alice\n")
    with pytest.raises(GradeError, match="has no column 'Student'"):
        Roster.read(tmp_path / "bad.csv")


def test_roster_and_student_depth_mistakes_stop_before_grading(tmp_path, capsys):
    from ddplab.course.cli import main

    reference, submitted = tiny_course(tmp_path, "x = 2")
    grade = ["grade", str(submitted), "--reference", str(reference)]
    assert main([*grade, "--roster", str(tmp_path / "r.csv")]) == 2
    assert "--roster is for --canvas" in capsys.readouterr().err
    assert main([*grade, "--student-depth", "-1"]) == 2
    assert "--student-depth -1 is negative" in capsys.readouterr().err
    assert main([*grade, "--canvas", str(tmp_path / "c.csv"), "--roster", str(tmp_path / "no.csv")]) == 2
    said = capsys.readouterr().err
    assert "cannot be read" in said and "Grades > Export" in said and not (tmp_path / "c.csv").exists()


@pytest.mark.slow               # it grades: a kernel per submission
def test_a_class_with_sections_and_a_late_copy_is_graded_by_student_in_every_export(tmp_path):
    # issue 58: sec1/alice (passes) and sec1/bob (stub) were one student "sec1" with 0 points;
    # sec1/alice and sec2/alice lost their names; alice/ps1 (passes) beside alice/ps1_late (stub)
    # gave her 0 in Canvas and 1 of 2 in Gradescope; a folder "=cmd|calc" reached Canvas raw.
    import os
    import time

    from ddplab.grade.class_run import grade

    reference, submitted = tiny_course(tmp_path, "x = 1")
    passing = (submitted / "mallory" / "loud.ipynb").read_text()
    stub = passing.replace("x = 1", "raise NotImplementedError()")
    hand_ins = {"sec1/alice": passing, "sec1/bob": stub, "sec2/alice": stub, "sec1/=cmd|calc": passing,
                "sec2/carol/ps1": passing, "sec2/carol/ps1_late": stub}
    for folder, text in hand_ins.items():
        (tmp_path / "class" / folder).mkdir(parents=True)
        (tmp_path / "class" / folder / "loud.ipynb").write_text(text)
    earlier = time.time() - 60                               # ps1_late is the older copy here
    os.utime(tmp_path / "class" / "sec2" / "carol" / "ps1_late" / "loud.ipynb", (earlier, earlier))
    grades = grade([tmp_path / "class"], reference, jobs=3)
    expected = [("sec1", "=cmd|calc", 1), ("sec1", "alice", 1), ("sec1", "bob", 0),
                ("sec2", "alice", 0), ("sec2", "carol", 1)]         # carol: ps1, her newest
    assert [(g.section, g.student, g.score) for g in grades] == expected
    [carol] = [g for g in grades if g.student == "carol"]
    assert carol.path.endswith("carol/ps1/loud.ipynb") and len(carol.copies) == 1

    table = report.table(grades)
    assert [line.split()[:3] for line in table.splitlines()[1:6]] == [
        [f"{s}/{n}", "loud", f"{p}/1"] for s, n, p in expected]
    assert re.search(r"^sec2/carol +loud: graded \S+/carol/ps1/loud.ipynb, the newest of 2 copies; "
                     r"not graded: \S+/carol/ps1_late/loud.ipynb \(an older copy\)$", table, re.M), table
    head, *rows = _csv(report.to_csv(grades))
    assert [(r[head.index("section")], r[0], int(r[head.index("score")])) for r in rows] == [
        ("sec1", "'=cmd|calc", 1), *expected[1:]]
    canvas = _csv(report.to_canvas(grades))
    assert [(r[4], r[0], r[3], int(r[5])) for r in canvas[2:]] == [
        ("sec1", "'=cmd|calc", "'=cmd|calc", 1), *((s, n, n, p) for s, n, p in expected[1:])]
    cases = list(ET.fromstring(report.to_junit(grades)).iter("testcase"))
    assert [(c.get("classname"), c.find("failure") is None) for c in cases] == [
        (f"loud.{s}/{n}", bool(p)) for s, n, p in expected]
    results = json.loads(report.to_gradescope([carol]))
    assert results["score"] == 1 and [t["name"] for t in results["tests"]] == ["loud: loud"]
