"""Grades as a table for people, CSV for a gradebook, JUnit XML for CI systems, Gradescope's
``results.json`` and a gradebook CSV that Canvas imports.

All take the list of ``ddplab.grade.class_run.Grade`` that ``grade()`` returns:
one per student and notebook (a student's other copies of a notebook are listed
with it, never rows of their own). A student in a section is shown as
``section/student``. The table shows one row per submission, ``pass``/``FAIL``
per exercise and the total, then each lost exercise with why: a check's feedback
whole, as the student saw it in the notebook (headline, table, hint), indented
under its first line::

    student  notebook        total  total_ex  ring
    alice    01_p2p          2/2    pass      pass
    bob      01_p2p          1/2    pass      FAIL

    bob      ring: check: token is wrong on rank 1.
                    rank 0: expected ...
                    Hint: ...

Every export carries that same text (``Mark.reason``): the CSV's reasons,
JUnit's failure, Gradescope's ``output``; a passed exercise carries its
check's pass line (``Mark.output``) where the format has room for it.
"""

from __future__ import annotations

import json
from xml.etree import ElementTree as ET

from .gradebook import CANVAS_IDENTITY, to_canvas, write_rows

__all__ = ["CANVAS_IDENTITY", "table", "to_canvas", "to_csv", "to_gradescope", "to_junit"]


def _who(g) -> str:
    """The student as the table and JUnit show them: ``section/student`` in a section."""
    return f"{g.section}/{g.student}" if g.section else g.student


def _copies(g) -> str:
    """The line that says which copy was graded, where the student handed in more than one."""
    return (f"{g.notebook}: graded {g.path}, the newest of {len(g.copies) + 1} copies; not graded: "
            f"{'; '.join(g.copies)}") if g.copies else ""


def _columns(grades) -> list[str]:
    """Every exercise name, in the order the notebooks define them."""
    names: list[str] = []
    for g in grades:
        for mark in g.marks:
            if mark.exercise not in names:
                names.append(mark.exercise)
    return names


def _cell(g, name: str) -> str:
    mark = next((m for m in g.marks if m.exercise == name), None)
    if mark is None or g.error:
        return "-"
    return "pass" if mark.passed else "FAIL"


def table(grades) -> str:
    """A fixed-width score table, then the reason for each failure."""
    names = _columns(grades)
    head = ["student", "notebook", "total", *names]
    rows = [[_who(g), g.notebook, "error" if g.error else f"{g.score}/{len(g.marks)}",
             *(_cell(g, n) for n in names)] for g in grades]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    reasons = []
    who = max((len(_who(g)) for g in grades), default=0)
    for g in grades:
        if g.copies:
            reasons.append(f"{_who(g).ljust(who)}  {_copies(g)}")
        if g.error:
            reasons.append(f"{_who(g).ljust(who)}  error: {g.error}")
            continue
        for m in g.marks:
            if not m.passed:
                first, *rest = (m.reason or "").splitlines() or [""]
                head = f"{_who(g).ljust(who)}  {m.exercise}: "
                reasons += [head + first, *(" " * len(head) + line for line in rest)]
    return "\n".join(lines + ([""] + reasons if reasons else [])) + "\n"


def to_csv(grades) -> str:
    """One row per submission: 1/0 per exercise, score, out of, the reasons, the student's section
    and their other copies; no cell a spreadsheet would run (``gradebook.spreadsheet_cell``)."""
    names = _columns(grades)
    rows: list[list] = [["student", "notebook", *names, "score", "out_of", "error", "reasons",
                         "section", "copies"]]
    for g in grades:
        passed = {m.exercise: int(m.passed) for m in g.marks}
        rows.append([g.student, g.notebook, *(passed.get(n, "") for n in names),
                     g.score, len(g.marks), g.error,
                     "; ".join(f"{m.exercise}: {m.reason}" for m in g.marks
                               if not m.passed and not g.error),
                     g.section, _copies(g)])
    return write_rows(rows)


def to_junit(grades) -> str:
    """JUnit XML: a test suite per notebook, a test case per student and exercise."""
    suites = ET.Element("testsuites", name="ddplab grade")
    for notebook in dict.fromkeys(g.notebook for g in grades):
        mine = [g for g in grades if g.notebook == notebook]
        suite = ET.SubElement(suites, "testsuite", name=notebook)
        tests = failures = errors = 0
        for g in mine:
            classname = f"{notebook}.{_who(g)}"
            if g.error:
                case = ET.SubElement(suite, "testcase", classname=classname, name="notebook",
                                     time=f"{g.seconds:.1f}")
                ET.SubElement(case, "error", message=g.error)
                tests, errors = tests + 1, errors + 1
                continue
            for m in g.marks:
                case = ET.SubElement(suite, "testcase", classname=classname, name=m.exercise,
                                     time=f"{m.seconds:.1f}")
                if not m.passed:
                    # The first line as the message (what a CI list shows), the whole feedback as text.
                    failure = ET.SubElement(case, "failure", message=(m.reason or "").split("\n")[0])
                    failure.text = m.reason
                    failures += 1
                elif m.output:
                    ET.SubElement(case, "system-out").text = m.output
                tests += 1
        suite.set("tests", str(tests))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def to_gradescope(grades) -> str:
    """Gradescope's ``results.json`` for one student's submission: a test per exercise.

    Gradescope runs its autograder once per student, so ``grades`` are one
    student's notebooks. Each test's ``output`` is what the student saw in the
    notebook: a lost exercise's feedback whole (the headline that names the
    mistake, the per-rank table, the hint; never the answer), a passed one's
    ``Correct:`` line.
    """
    tests = []
    for g in grades:
        if g.error:
            tests.append({"name": f"{g.notebook}: not graded", "score": 0,
                          "max_score": max(len(g.marks), 1), "output": g.error,
                          "visibility": "visible"})
            continue
        tests += [{"name": f"{g.notebook}: {m.exercise}", "score": int(m.passed), "max_score": 1,
                   "output": m.output if m.passed else m.reason, "visibility": "visible"}
                  for m in g.marks]
    results = {"score": sum(t["score"] for t in tests), "tests": tests,
               "stdout_visibility": "hidden"}
    copies = [_copies(g) for g in grades if g.copies]
    if copies:
        results["output"] = "\n".join(copies)
    return json.dumps(results, indent=1) + "\n"
