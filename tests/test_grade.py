"""`ddplab grade` on real notebooks, real kernels, real labs.

The reference is notebook 01 (seven exercises). Each submission breaks some
exercises, each in one way, and must lose exactly those. The breakages that
need the grader to recover (deadlocks, an infinite loop, a kernel crash) sit
in their own submissions, with untouched exercises after them, so a spill
would show; the cheap breakages share one submission. All are graded in ONE
call, in parallel as they would be for a course, shared by the tests below.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import nbformat
import pytest
from conftest import lab_dirs, my_process_tree

from ddplab.course.release import release_notebook
from ddplab.grade import report
from ddplab.grade.class_run import grade
from ddplab.grade.compare import sanitize, sanitize_patterns

ROOT = Path(__file__).resolve().parent.parent
NAME = "01_point_to_point.ipynb"
REFERENCE = ROOT / "notebooks" / NAME
# The infinite loop costs this much, and it is the run's longest submission (the
# loop, then the replay after it). Honest cells are far quicker, but a lab start
# on two cores shared with other labs has taken 30 s: twice that, as in
# tests/test_grade_hostile.py.
CELL_TIMEOUT = 60
# in notebook order
EXERCISES = ["who-waited", "ping-pong", "isend-waited", "swap", "ring-token",
             "neighbour-exchange", "all-gather-p2p"]


def _cell(nb, cell_id):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def _replace(nb, cell_id, old, new):
    cell = _cell(nb, cell_id)
    assert old in cell.source, (cell_id, old)
    cell.source = cell.source.replace(old, new)


def _solutions_into_stubs(student, reference):
    """What a student who solves everything hands in: the released notebook, stubs filled."""
    for cell in student.cells:
        if cell.get("id", "").startswith("exercise-"):
            cell.source = _cell(reference, cell.id).source
    return student


def _mixed(nb):
    nb.cells.remove(_cell(nb, "check-ping-pong"))                              # deleted check
    _replace(nb, "exercise-swap", "return received", "return t")               # wrong result
    _replace(nb, "exercise-ring-token", "left, right = (rank - 1)",            # an exception
             "left, right = undefined_name + (rank - 1)")
    _cell(nb, "check-neighbour-exchange").source = \
        "# I only added a comment\n" + _cell(nb, "check-neighbour-exchange").source   # edited check
    nb.cells.append(nbformat.v4.new_code_cell("print(my_scratch_name)", id="my-scratch"))  # costs no mark


def _deadlocks(nb):
    # every rank receives first: in a function the checker runs (its own timeout
    # catches it), and in a %%ranks cell (the lab's HangError; the lab needs a restart)
    _replace(nb, "exercise-swap",
             "requests = [dist.isend(t, dst=other), dist.irecv(received, src=other)]",
             "dist.recv(received, src=other)\n    requests = []")
    _replace(nb, "exercise-ring-token",
             "    dist.send(token, dst=right)\n    dist.recv(token, src=left)\nelse",
             "    dist.recv(token, src=left)\n    dist.send(token, dst=right)\nelse")


def _stripped(nb) -> str:
    """``nb`` as an editor that strips cell ids and tags saves it (nbformat 4.4, no ids)."""
    data = json.loads(nbformat.writes(nb))
    for cell in data["cells"]:
        cell.pop("id", None)
        cell["metadata"].pop("tags", None)
    data["nbformat_minor"] = 4
    return json.dumps(data)


def submissions(reference):
    """Variant name -> (notebook or raw text, the exercises it must lose); slow ones first."""
    released = release_notebook(reference)
    out = {}

    def variant(name, lose, change=None):
        nb = _solutions_into_stubs(nbformat.from_dict(released), reference)
        if change:
            change(nb)
        out[name] = (nb, set(lose))

    variant("deadlock", ["swap", "ring-token"], _deadlocks)
    variant("loops", ["ping-pong"],                          # in the kernel: the cell timeout
            lambda nb: setattr(_cell(nb, "exercise-ping-pong"), "source", "while True:\n    pass"))
    variant("crash", ["ping-pong"],                          # the kernel dies, leaving a folder
            lambda nb: setattr(_cell(nb, "exercise-ping-pong"), "source",
                               "import os, tempfile\ntempfile.mkdtemp(prefix='ddplab-left-')\nos._exit(1)"))
    variant("mixed", ["ping-pong", "swap", "ring-token", "neighbour-exchange"], _mixed)
    variant("correct", [])
    # the correct notebook again, its ids and tags stripped: it scored 0, "check cell was deleted"
    out["stripped"] = (_stripped(out["correct"][0]), set())
    out["stubs"] = (released, set(EXERCISES))
    out["not_json"] = ('{"cells": [{"cell_type": "code", "source": "x = 1"', set(EXERCISES))
    return out


# One grading run of seven submissions on two cores shared with other labs;
# test_the_command... below adds one more process start.
pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every variant graded in one call; also: the processes alive before and after."""
    tmp = tmp_path_factory.mktemp("grading")
    reference = nbformat.read(REFERENCE, as_version=4)
    variants = submissions(reference)
    paths = []
    for student, (nb, _) in variants.items():
        (tmp / "submitted" / student).mkdir(parents=True)
        path = tmp / "submitted" / student / NAME
        path.write_text(nb if isinstance(nb, str) else nbformat.writes(nb))
        paths.append(path)
    before, dirs = my_process_tree(), lab_dirs()
    grades = grade(paths, ROOT / "notebooks", jobs=3, cell_timeout=CELL_TIMEOUT)
    left = (my_process_tree() - before) | (lab_dirs() - dirs)     # pids, and ddplab-* folders
    return {g.student: g for g in grades}, variants, left, tmp


def test_each_submission_loses_exactly_the_exercises_it_breaks(graded):
    grades, variants, _, _ = graded
    assert list(grades) == list(variants)
    for student, (_, lose) in variants.items():
        g = grades[student]
        lost = {m.exercise for m in g.marks if not m.passed}
        assert [m.exercise for m in g.marks] == EXERCISES, student
        assert lost == lose, f"{student}: lost {lost}, expected {lose}; {g}"
        assert g.score == len(EXERCISES) - len(lose)


@pytest.mark.exercise("who_waited", "stub")
@pytest.mark.exercise("ping_pong", "stub")
@pytest.mark.exercise("swap_tensors", "stub")
@pytest.mark.exercise("ring_token", "stub")
@pytest.mark.exercise("neighbour_exchange", "stub")
@pytest.mark.exercise("all_gather_p2p", "stub")
def test_each_failure_has_a_short_reason_that_names_the_cause(graded):
    grades = graded[0]
    reason = {s: {m.exercise: m.reason for m in g.marks if not m.passed} for s, g in grades.items()}
    # the checker stops the hang itself (its own timeout) and says why
    assert reason["deadlock"]["swap"].startswith("check: ") and "deadlock" in reason["deadlock"]["swap"]
    assert reason["deadlock"]["ring-token"].startswith("exercise cell: HangError: a deadlock")
    assert "still in recv" in reason["deadlock"]["ring-token"]
    assert f"exercise cell: timed out after {CELL_TIMEOUT} s" in reason["loops"]["ping-pong"]
    assert "exercise cell: the kernel died" in reason["crash"]["ping-pong"]
    mixed = reason["mixed"]
    assert mixed["ping-pong"].startswith("check cell check-ping-pong was deleted")
    assert mixed["swap"].startswith("check: swap(t) with an input of shape [1] and dtype float32 is "
                                    "wrong on ranks 0, 1.\n  rank 0: expected "), mixed["swap"]
    assert "\nHint: " in mixed["swap"]                # the check's whole feedback, as the notebook shows it
    assert "raised NameError: name 'undefined_name' is not defined" in mixed["ring-token"]
    assert mixed["neighbour-exchange"].startswith("check cell check-neighbour-exchange was edited")
    assert "not valid JSON" in grades["not_json"].error
    assert grades["mixed"].cells_failed == [
        "cell my-scratch: error: NameError: name 'my_scratch_name' is not defined"]
    assert grades["correct"].cells_failed == []
    for name, why in reason["stubs"].items():
        assert "NotImplementedError" in why, (name, why)
    # A reason's first line is short (what a table or a CI list shows); a check's reason goes on with
    # the rest of its feedback, the notebook's text (issue 53: exports kept only the first line).
    for g in grades.values():
        for m in g.marks:
            assert len(m.reason.split("\n")[0]) <= 200, m.reason
            assert "\n" not in m.reason or m.reason.startswith("check: "), m.reason
    assert "\nHint: " in mixed["swap"] and "\n  rank 1: expected " in mixed["swap"]


def test_nothing_is_left_running_after_hangs_loops_and_crashes(graded):
    assert graded[2] == set(), f"processes or ddplab-* folders left behind by grading: {graded[2]}"


def test_table_csv_and_junit_say_the_same(graded):
    grades = list(graded[0].values())
    students = list(graded[0])
    text = report.table(grades)
    lines = text.splitlines()
    assert lines[0].split() == ["student", "notebook", "total", *EXERCISES]
    assert lines[1 + students.index("correct")].split() == \
        ["correct", "01_point_to_point", "7/7", *["pass"] * 7]
    assert lines[1 + students.index("deadlock")].split() == \
        ["deadlock", "01_point_to_point", "5/7",
         "pass", "pass", "pass", "FAIL", "FAIL", "pass", "pass"]
    assert re.search(r"^not_json\s+error: not graded: not valid JSON", text, re.M)
    assert re.search(r"^deadlock\s+swap: check: .*deadlock", text, re.M)

    rows = {r["student"]: r for r in csv.DictReader(io.StringIO(report.to_csv(grades)))}
    assert rows["deadlock"]["swap"] == "0" and rows["deadlock"]["neighbour-exchange"] == "1"
    assert rows["deadlock"]["score"] == "5" and rows["deadlock"]["out_of"] == "7"
    assert rows["not_json"]["error"].startswith("not graded: not valid JSON")

    suite = ET.fromstring(report.to_junit(grades)).find("testsuite")
    assert suite.get("name") == "01_point_to_point"
    # each exercise its own time, as its cells took (it was the notebook's time shared equally)
    times = [float(c.get("time")) for c in suite.iter("testcase")
             if c.get("classname") == "01_point_to_point.correct"]
    assert len(set(times)) > 1 and sum(times) <= graded[0]["correct"].seconds, times
    failed = {(c.get("classname"), c.get("name")) for c in suite.iter("testcase")
              if c.find("failure") is not None}
    assert ("01_point_to_point.deadlock", "swap") in failed
    assert ("01_point_to_point.correct", "swap") not in failed
    assert suite.get("errors") == "1"       # not_json


def test_the_command_prints_the_table_and_writes_csv_and_junit(graded):
    _, _, _, tmp = graded
    # the real command on the quick one (the table's rows are checked above)
    result = subprocess.run(
        [sys.executable, "-m", "ddplab.course.cli", "grade", str(tmp / "submitted" / "not_json"),
         "--reference", str(ROOT / "notebooks"), "--csv", str(tmp / "g.csv"),
         "--junit", str(tmp / "g.xml"), "--cell-timeout", "120"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr     # not every exercise passed
    assert re.search(r"^not_json\s+01_point_to_point\s+error(\s+-){7}$", result.stdout, re.M)
    assert "not_json  error: not graded: not valid JSON" in result.stdout
    assert "1 submission graded in" in result.stdout
    assert (tmp / "g.csv").read_text().startswith("student,notebook,who-waited,ping-pong,isend-waited,swap,")
    ET.parse(tmp / "g.xml")


def test_a_reference_without_check_outputs_stops_grading_with_the_fix(tmp_path):
    reference = nbformat.read(REFERENCE, as_version=4)
    for cell in reference.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    nbformat.write(reference, tmp_path / NAME)
    result = subprocess.run([sys.executable, "-m", "ddplab.course.cli", "grade", str(tmp_path / NAME),
                             "--reference", str(tmp_path / NAME)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "check cell check-who-waited" in result.stderr and "Execute and clean" in result.stderr
    assert "docs/contributing.md" in result.stderr                 # where the fix is written down


# ------------------------------------------------------------- the sanitize file
SANITIZED = {
    "[W1121 08:12:39.123456789 ProcessGroupGloo.cpp:514] Warning: Unable to resolve hostname\nok\n": "ok\n",
    "[rank0]:[W1121 08:12:39.123456 4242 ProcessGroupNCCL.cpp:1234] Warning: x\nok\n": "ok\n",
    "[W ProcessGroupGloo.cpp:721] Warning: Unable to resolve hostname.\nok\n": "ok\n",
    "node7:4242:4300 [0] NCCL WARN Call to connect returned\nok\n": "ok\n",
    "gpu1:77:77 [1] NCCL INFO Bootstrap : Using eth0\nok\n": "ok\n",
    "<Foo object at 0x7f3a2c1d5e80>": "<Foo object at 0xADDRESS>",
    "127.0.0.1:29500 localhost:8888 tcp://10.0.0.2:5555": "127.0.0.1:PORT localhost:PORT tcp://10.0.0.2:PORT",
    "MASTER_PORT=29500, port 29500": "MASTER_PORT=PORT, port PORT",
    "pid 4242, pid=4242, PID: 4242": "pid PID, pid=PID, PID: PID",
    "hostname=node7, host: gpu-box.local": "hostname=HOST, host: HOST",
    "0.52 s, 1.234ms, 12 ms, 800us, 0:00:01.234567, took 3 seconds, 12 s elapsed":
        "TIME, TIME, TIME, TIME, TIME, took TIME, TIME elapsed",
    "100%|██████████| 20/20 [00:01<00:00, 19.50it/s]\n3it [00:00, 79638.68it/s]\n"
    " 15%|█▌        | 3/20 [1:02:03<?, ?it/s]\n 5/20 [00:02<00:06, 2.03s/it, loss=0.25]":
        "100%|██████████| 20/20 [TIME]\n3it [TIME]\n 15%|█▌        | 3/20 [TIME]\n 5/20 [TIME]",
    "<!-- ddplab-trace --><div>\n<svg><rect x=\"3.5\"/></svg></div><!-- /ddplab-trace -->":
        "<!-- ddplab-trace -->",
    "gather_object to 0 (644 B), broadcast_object_list from 0 (1.95 kB), all_gather_object (12 B)":
        "gather_object to 0 (SIZE), broadcast_object_list from 0 (SIZE), all_gather_object (SIZE)",
}
UNTOUCHED = ["[rank 0]\nI am rank 0 of 2\ndist agrees: 0 2\n", "tensor([1., 2., 3.])",
             "all_reduce (209 kB, by torch), broadcast from 0 (4 B, by torch)",
             "MASTER_PORT is a port number: True\n", "correct: every rank holds 10.0\n",
             "[10, 11]", "step 3 of 10: loss 0.25"]


@pytest.mark.parametrize("text", list(SANITIZED))
def test_the_sanitize_file_hides_what_differs_between_machines(text):
    assert sanitize(text, sanitize_patterns()) == SANITIZED[text]


@pytest.mark.parametrize("text", UNTOUCHED)
def test_the_sanitize_file_leaves_lesson_output_alone(text):
    assert sanitize(text, sanitize_patterns()) == text


def test_nbval_reads_every_pattern_of_the_sanitize_file():
    """nbval silently drops a pair whose `replace:` lost its space; count them."""
    text = (ROOT / "ddplab" / "grade" / "nbval_sanitize.cfg").read_text()
    assert len(sanitize_patterns()) == text.count("\nregex: ") == 15
    json.dumps(sanitize_patterns())
    # ddplab reads the file itself (a student's install has no nbval); nbval, which `make test`
    # and grading's comparisons use, must read the same pairs from it.
    from nbval.plugin import get_sanitize_patterns
    assert get_sanitize_patterns(text) == sanitize_patterns()
