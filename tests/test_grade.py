"""`ddplab grade` on real notebooks, real kernels, real labs.

The reference is a course notebook with several exercises: notebook 00 plus
two exercises added here (the check cells' reference outputs are the fixed
lines they print). Each broken submission breaks one exercise in one way and
must lose exactly that exercise. All submissions are graded in ONE call, so
they run in parallel as they would for a course, and that call is shared by
the tests below.
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

from conftest import my_process_tree
from ddplab import report
from ddplab.grade import grade
from ddplab.grade_run import sanitize, sanitize_patterns
from ddplab.release import release_notebook

ROOT = Path(__file__).resolve().parent.parent
NAME = "02_grading.ipynb"
CELL_TIMEOUT = 60          # the infinite loop costs this much; every honest cell is far quicker
EXERCISES = ["total", "biggest", "square"]


def _code(source, cell_id=None, tag=None, outputs=()):
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [tag]} if tag else {})
    cell.id = cell_id or cell.id
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in outputs]
    return cell


def reference_notebook():
    """Notebook 00 (exercise `total`) plus `biggest` (on the ranks) and `square` (in the kernel)."""
    nb = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    for cell in nb.cells:        # a short lab timeout, so the deadlock costs 20 s, not 60
        cell.source = cell.source.replace("ddplab.start(world_size=2)",
                                          "ddplab.start(world_size=2, timeout=20)")
    stop = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Stop the lab"))
    nb.cells[stop:stop] = [
        nbformat.v4.new_markdown_cell("## Exercise: the biggest rank\nPut the largest rank into `biggest`."),
        _code("%%ranks\n### BEGIN SOLUTION\nbiggest = torch.tensor([float(rank)])\n"
              "dist.all_reduce(biggest, op=dist.ReduceOp.MAX)\n### END SOLUTION",
              "exercise-biggest", "exercise"),
        _code("got = [t.item() for t in ddplab.check.values_on_ranks('biggest')]\n"
              "assert got == [1.0, 1.0], f'expected [1.0, 1.0], got {got}'\n"
              "print('correct: the biggest rank is', int(got[0]))",
              "check-biggest", "check", ["correct: the biggest rank is 1\n"]),
        nbformat.v4.new_markdown_cell("## Exercise: square\nWrite `square(x)`."),
        _code("def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION",
              "exercise-square", "exercise"),
        _code("assert [square(i) for i in range(4)] == [0, 1, 4, 9]\nprint('correct: square works')",
              "check-square", "check", ["correct: square works\n"]),
    ]
    return nb


def _replace(nb, cell_id, old, new):
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    assert old in cell.source, (cell_id, old)
    cell.source = cell.source.replace(old, new)


def _solutions_into_stubs(student, reference):
    """What a student who solves everything hands in: the released notebook, stubs filled."""
    solution = {c.id: c.source for c in reference.cells}
    for cell in student.cells:
        if cell.get("id", "").startswith("exercise-"):
            cell.source = solution[cell.id]
    return student


def submissions(reference):
    """Variant name -> (notebook or raw text, the exercises it must lose)."""
    released = release_notebook(reference)
    out = {}

    def variant(name, lose, change=None):
        nb = _solutions_into_stubs(nbformat.from_dict(released), reference)
        if change:
            change(nb)
        out[name] = (nb, lose)

    # slow ones first, so they overlap with the rest
    variant("loops", {"square"}, lambda nb: _replace(nb, "exercise-square", "return x * x",
                                                     "while True:\n        pass"))
    variant("deadlock", {"total"}, lambda nb: _replace(
        nb, "exercise-total", "dist.all_reduce(total)", "dist.recv(total, src=(rank + 1) % 2)"))
    variant("crash", {"biggest"}, lambda nb: _replace(
        nb, "exercise-biggest", "%%ranks\n", "import os\nos._exit(1)\n"))
    variant("correct", set())
    variant("wrong", {"total"}, lambda nb: _replace(nb, "exercise-total", "10.0 * rank", "1.0 * rank"))
    variant("raises", {"biggest"}, lambda nb: _replace(
        nb, "exercise-biggest", "biggest = torch", "biggest = undefined_name + torch"))
    variant("no_check", {"biggest"},
            lambda nb: nb.cells.remove(next(c for c in nb.cells if c.get("id") == "check-biggest")))
    variant("edited_check", {"square"}, lambda nb: _replace(
        nb, "check-square", "assert [square(i) for i in range(4)] == [0, 1, 4, 9]\n", ""))
    out["stubs"] = (released, set(EXERCISES))
    out["not_json"] = ('{"cells": [{"cell_type": "code", "source": "x = 1"', set(EXERCISES))
    return out


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every variant graded in one call; also: the processes alive before and after."""
    tmp = tmp_path_factory.mktemp("grading")
    reference = reference_notebook()
    (tmp / "course").mkdir()
    nbformat.write(reference, tmp / "course" / NAME)
    variants = submissions(reference)
    paths = []
    for student, (nb, _) in variants.items():
        (tmp / "submitted" / student).mkdir(parents=True)
        path = tmp / "submitted" / student / NAME
        path.write_text(nb if isinstance(nb, str) else nbformat.writes(nb))
        paths.append(path)
    before = my_process_tree()
    grades = grade(paths, tmp / "course", jobs=2, cell_timeout=CELL_TIMEOUT)
    left = my_process_tree() - before
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


def test_each_failure_has_a_short_reason_that_names_the_cause(graded):
    grades = graded[0]
    reason = {s: next((m.reason for m in g.marks if not m.passed), g.error) for s, g in grades.items()}
    assert "AssertionError: expected total per rank [10.0, 10.0], got [1.0, 1.0]" in reason["wrong"]
    assert "rank 0 raised NameError" in reason["raises"]
    assert "HangError" in reason["deadlock"] and "deadlock" in reason["deadlock"]
    assert f"timed out after {CELL_TIMEOUT} s" in reason["loops"]
    assert "kernel died" in reason["crash"]
    assert "check cell check-biggest was deleted" in reason["no_check"]
    assert "check cell check-square was edited" in reason["edited_check"]
    assert "not valid JSON" in grades["not_json"].error
    for mark in grades["stubs"].marks:
        assert "NotImplementedError" in mark.reason, mark
    for g in grades.values():
        assert all(len(m.reason) <= 200 and "\n" not in m.reason for m in g.marks)


def test_nothing_is_left_running_after_hangs_loops_and_crashes(graded):
    assert graded[2] == set(), f"processes left behind by grading: {graded[2]}"


def test_table_csv_and_junit_say_the_same(graded):
    grades = list(graded[0].values())
    text = report.table(grades)
    lines = text.splitlines()
    assert lines[0].split() == ["student", "notebook", "total", *EXERCISES]
    assert lines[1 + list(graded[0]).index("correct")].split() == \
        ["correct", "02_grading", "3/3", "pass", "pass", "pass"]
    assert lines[1 + list(graded[0]).index("wrong")].split() == \
        ["wrong", "02_grading", "2/3", "FAIL", "pass", "pass"]
    assert re.search(r"^not_json\s+error: not graded: not valid JSON", text, re.M)
    assert re.search(r"^deadlock\s+total: exercise cell: HangError", text, re.M)

    rows = {r["student"]: r for r in csv.DictReader(io.StringIO(report.to_csv(grades)))}
    assert rows["wrong"]["total"] == "0" and rows["wrong"]["square"] == "1"
    assert rows["wrong"]["score"] == "2" and rows["wrong"]["out_of"] == "3"
    assert rows["not_json"]["error"].startswith("not graded: not valid JSON")

    suites = ET.fromstring(report.to_junit(grades))
    suite = suites.find("testsuite")
    assert suite.get("name") == "02_grading"
    failed = {(c.get("classname"), c.get("name")) for c in suite.iter("testcase")
              if c.find("failure") is not None}
    assert ("02_grading.wrong", "total") in failed and ("02_grading.correct", "total") not in failed
    assert suite.get("errors") == "1"       # not_json


def test_the_command_prints_the_table_and_writes_csv_and_junit(graded):
    _, _, _, tmp = graded
    # the real command on the quick one (the table's rows are checked above)
    result = subprocess.run(
        [sys.executable, "-m", "ddplab.cli", "grade", str(tmp / "submitted" / "not_json"),
         "--reference", str(tmp / "course"), "--csv", str(tmp / "g.csv"),
         "--junit", str(tmp / "g.xml"), "--cell-timeout", "120"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr     # not every exercise passed
    assert re.search(r"^not_json\s+02_grading\s+error\s+-\s+-\s+-$", result.stdout, re.M)
    assert "not_json  error: not graded: not valid JSON" in result.stdout
    assert "1 submissions graded in" in result.stdout
    assert (tmp / "g.csv").read_text().startswith("student,notebook,total,biggest,square,score")
    ET.parse(tmp / "g.xml")


def test_a_reference_without_check_outputs_stops_grading_with_the_fix(tmp_path):
    reference = reference_notebook()
    for cell in reference.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    nbformat.write(reference, tmp_path / NAME)
    result = subprocess.run([sys.executable, "-m", "ddplab.cli", "grade", str(tmp_path / NAME),
                             "--reference", str(tmp_path / NAME)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "check cell check-total" in result.stderr and "Execute and clean" in result.stderr


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
}
UNTOUCHED = ["[rank 0]\nI am rank 0 of 2\ndist agrees: 0 2\n", "tensor([1., 2., 3.])",
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
    text = (ROOT / "ddplab" / "nbval_sanitize.cfg").read_text()
    assert len(sanitize_patterns()) == text.count("\nregex: ") == 12
    json.dumps(sanitize_patterns())
