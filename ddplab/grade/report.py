"""Grades as a table for people, CSV for a gradebook, and JUnit XML for CI systems.

All three take the list of ``ddplab.grade.class_run.Grade`` that ``grade()`` returns.
The table shows one row per submission, ``pass``/``FAIL`` per exercise and
the total, then one line per lost exercise saying why::

    student  notebook        total  total_ex  ring
    alice    01_p2p          2/2    pass      pass
    bob      01_p2p          1/2    pass      FAIL

    bob      ring: check: AssertionError: ring is wrong on rank 1.
"""

from __future__ import annotations

import csv
import io
from xml.etree import ElementTree as ET


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
    rows = [[g.student, g.notebook, "error" if g.error else f"{g.score}/{len(g.marks)}",
             *(_cell(g, n) for n in names)] for g in grades]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    reasons = []
    who = max((len(g.student) for g in grades), default=0)
    for g in grades:
        if g.error:
            reasons.append(f"{g.student.ljust(who)}  error: {g.error}")
            continue
        reasons += [f"{g.student.ljust(who)}  {m.exercise}: {m.reason}"
                    for m in g.marks if not m.passed]
    return "\n".join(lines + ([""] + reasons if reasons else [])) + "\n"


def to_csv(grades) -> str:
    """One row per submission: 1/0 per exercise, score, out of, and the reasons."""
    names = _columns(grades)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["student", "notebook", *names, "score", "out_of", "error", "reasons"])
    for g in grades:
        passed = {m.exercise: int(m.passed) for m in g.marks}
        writer.writerow([g.student, g.notebook, *(passed.get(n, "") for n in names),
                         g.score, len(g.marks), g.error,
                         "; ".join(f"{m.exercise}: {m.reason}" for m in g.marks
                                   if not m.passed and not g.error)])
    return out.getvalue()


def to_junit(grades) -> str:
    """JUnit XML: a test suite per notebook, a test case per student and exercise."""
    suites = ET.Element("testsuites", name="ddplab grade")
    for notebook in dict.fromkeys(g.notebook for g in grades):
        mine = [g for g in grades if g.notebook == notebook]
        suite = ET.SubElement(suites, "testsuite", name=notebook)
        tests = failures = errors = 0
        for g in mine:
            classname = f"{notebook}.{g.student}"
            if g.error:
                case = ET.SubElement(suite, "testcase", classname=classname, name="notebook",
                                     time="0")
                ET.SubElement(case, "error", message=g.error)
                tests, errors = tests + 1, errors + 1
                continue
            for m in g.marks:
                case = ET.SubElement(suite, "testcase", classname=classname, name=m.exercise,
                                     time=f"{g.seconds / max(len(g.marks), 1):.1f}")
                if not m.passed:
                    ET.SubElement(case, "failure", message=m.reason)
                    failures += 1
                tests += 1
        suite.set("tests", str(tests))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"
