"""The number of exercises, wherever it is written, is the notebook's (issue 53).

The grader counts an exercise per check cell (``ddplab.grade.plan.exercises``); a
notebook's introduction, README's table of notebooks, docs/students.md's table and
docs/instructors.md's example of ``ddplab grade``'s table must say the same. 01's
introduction once said five while the grader counted seven.
"""

import re
from pathlib import Path

import nbformat
import pytest

from ddplab.grade import report
from ddplab.grade.class_run import Grade
from ddplab.grade.compare import Mark
from ddplab.grade.plan import exercises

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
         "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}
# "Seven exercises", "one graded exercise", "There are 7 exercises"
COUNT = re.compile(r"\b(" + "|".join(WORDS) + r"|\d+) (?:graded )?exercises?\b", re.I)


def graded_exercises(path: Path) -> list[str]:
    return [e.name for e in exercises(nbformat.read(path, as_version=4))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_introduction_says_how_many_exercises_the_grader_counts(path):
    intro = nbformat.read(path, as_version=4).cells[0].source
    said = [m.group(1).lower() for m in COUNT.finditer(intro)]
    assert len(said) == 1, f"{path.name}'s introduction should say its number of exercises once: {said}"
    number = WORDS.get(said[0]) or int(said[0])
    assert number == len(graded_exercises(path)), \
        f"{path.name}'s introduction says {said[0]}, the grader counts {len(graded_exercises(path))}"


def _table_rows(text: str, link: str) -> dict[str, str]:
    """Notebook file name -> its table row, for rows that link a notebook."""
    rows = {}
    for line in text.splitlines():
        found = re.match(r"\| \[[^\]]*\]\(" + re.escape(link) + r"([\w]+\.ipynb)\)", line)
        if found:
            rows[found.group(1)] = line
    return rows


def test_readme_and_the_students_table_give_each_notebooks_count():
    readme = _table_rows((ROOT / "README.md").read_text(), "notebooks/")
    students = {name.strip("`"): row for name, row in
                _table_rows((ROOT / "docs" / "students.md").read_text(), "../notebooks/").items()}
    assert sorted(readme) == sorted(students) == [p.name for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        n = len(graded_exercises(path))
        assert readme[path.name].endswith(f"| {n} |"), readme[path.name][-60:]
        unit = "exercise" if n == 1 else "exercises"
        assert students[path.name].endswith(f"; {n} {unit} |"), students[path.name][-60:]


def test_the_instructors_example_table_is_what_ddplab_grade_prints_for_notebook_01():
    """docs/instructors.md shows alice (all right), bob (swap wrong) and carol (not JSON)."""
    names = graded_exercises(ROOT / "notebooks" / "01_point_to_point.ipynb")
    grades = [Grade("alice", "01_point_to_point", "a", [Mark(n, True) for n in names]),
              Grade("bob", "01_point_to_point", "b", [Mark(n, n != "swap", "check: x" * (n == "swap"))
                                                      for n in names]),
              Grade("carol", "01_point_to_point", "c", [Mark(n, False, "not graded") for n in names],
                    error="not graded: not valid JSON")]
    printed = report.table(grades).split("\n\n")[0]
    guide = (ROOT / "docs" / "instructors.md").read_text()
    assert printed in guide, f"docs/instructors.md's example table should read:\n{printed}"
