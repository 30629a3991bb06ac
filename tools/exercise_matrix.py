"""Which tests cover each exercise: a row per check cell, four kinds of test per row.

    python tools/exercise_matrix.py [--allow-incomplete] [--notebook 01] [--root DIR]

An exercise is a check cell of a course notebook (tagged ``check``) and the
``ddplab.check.<name>(`` call in it; a checker called from two cells
(``who_waited``) is two exercises. Each needs four kinds of test (issue 54):

- ``stub``: the released stub (``NotImplementedError``) fails the check, named;
- ``mistake``: a plausible mistake is refused with its named message; two of them;
- ``bypass``: a deliberate bypass (the answer without the work) is refused;
- ``alternative``: a correct solution written differently from the reference
  (another author's style: wrapper classes, other layouts, aliases) is accepted.

A test says what it covers with a marker (registered in ``pyproject.toml``)::

    @pytest.mark.exercise("ring_token", "mistake", "sends to the wrong neighbour")
    def test_ring_token_names_a_wrong_neighbour(...): ...

The arguments: the checker's name, the kind, and for a mistake what it is (two
marks with different mistakes count as two, on one test or two). ``cell=`` picks
one check cell of a checker called from several (``cell="check-isend-waited"``);
without it the mark covers every cell that calls the checker. Marks on a class,
or a module's ``pytestmark``, cover each of their tests. The tool reads the marks
with ``ast`` from ``tests/**/*.py``: nothing runs. A mark that names no exercise
or no known kind is an error (a typo would hide a missing test).

It prints a table per notebook and exits 1 when a row is incomplete, unless
``--allow-incomplete`` (what ``make test`` passes until every row is complete).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("stub", "mistake", "bypass", "alternative")
#: How many distinct tests (or mistakes) of each kind a complete row has.
NEEDED = {"stub": 1, "mistake": 2, "bypass": 1, "alternative": 1}
CALL = re.compile(r"ddplab\.check\.(\w+)\(")
MARK = "exercise"


@dataclass
class Row:
    notebook: str                 # 01_point_to_point
    checker: str                  # ring_token
    cell: str                     # check-ring-token
    covered: dict[str, set] = field(default_factory=lambda: {kind: set() for kind in KINDS})

    def missing(self) -> list[str]:
        return [kind for kind in KINDS if len(self.covered[kind]) < NEEDED[kind]]


def exercises(root: Path) -> list[Row]:
    """A row per ``ddplab.check.<name>(`` call in a check cell of ``root/notebooks/*.ipynb``."""
    rows = []
    for path in sorted((root / "notebooks").glob("[0-9]*.ipynb")):
        for cell in json.loads(path.read_text()).get("cells", []):
            if cell.get("cell_type") != "code" or "check" not in cell.get("metadata", {}).get("tags", []):
                continue
            source = "".join(cell.get("source", ""))
            for name in CALL.findall(source):
                rows.append(Row(path.stem, name, cell.get("id", "?")))
    return rows


def _is_exercise_mark(node: ast.expr) -> bool:
    """``pytest.mark.exercise(...)`` or ``mark.exercise(...)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == MARK):
        return False
    owner = node.func.value
    return getattr(owner, "attr", getattr(owner, "id", "")) == "mark"


def _marks(expr: ast.expr) -> list[ast.Call]:
    items = expr.elts if isinstance(expr, (ast.List, ast.Tuple)) else [expr]
    return [item for item in items if _is_exercise_mark(item)]


@dataclass
class Declared:
    checker: str
    kind: str
    what: str
    cell: str | None
    test: str                     # tests/test_x.py::test_y
    where: str                    # tests/test_x.py:12


def declared(root: Path) -> tuple[list[Declared], list[str]]:
    """Every exercise mark in ``root/tests``: (the marks, the marks that are malformed)."""
    found, errors = [], []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        module_marks = [m for node in tree.body if isinstance(node, ast.Assign)
                        and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                        for m in _marks(node.value)]
        tests = []                                   # (test id, its own and its class's marks)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                outer = [m for d in node.decorator_list for m in _marks(d)]
                tests += [(f"{rel}::{node.name}::{f.name}", outer + [m for d in f.decorator_list
                                                                      for m in _marks(d)])
                          for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
            elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                tests.append((f"{rel}::{node.name}", [m for d in node.decorator_list for m in _marks(d)]))
        for test, marks in tests:
            for mark in module_marks + marks:
                try:
                    args = [ast.literal_eval(a) for a in mark.args]
                    kwargs = {k.arg: ast.literal_eval(k.value) for k in mark.keywords}
                except ValueError:
                    errors.append(f"{rel}:{mark.lineno}: exercise marks take literals only")
                    continue
                if len(args) < 2 or not all(isinstance(a, str) for a in args) or set(kwargs) - {"cell"}:
                    errors.append(f"{rel}:{mark.lineno}: write @pytest.mark.exercise(\"checker\", \"kind\""
                                  f"[, \"which mistake\"][, cell=\"check-cell-id\"])")
                    continue
                found.append(Declared(args[0], args[1], args[2] if len(args) > 2 else "",
                                      kwargs.get("cell"), test, f"{rel}:{mark.lineno}"))
    return found, errors


def matrix(root: Path) -> tuple[list[Row], list[str]]:
    """The rows with what covers them, and every problem with the marks."""
    rows, (marks, problems) = exercises(root), declared(root)
    by_checker: dict[str, list[Row]] = {}
    for row in rows:
        by_checker.setdefault(row.checker, []).append(row)
    for mark in marks:
        if mark.kind not in KINDS:
            problems.append(f"{mark.where}: kind {mark.kind!r} is not one of {', '.join(KINDS)}")
            continue
        targets = [r for r in by_checker.get(mark.checker, []) if mark.cell in (None, r.cell)]
        if not targets:
            known = "" if mark.checker in by_checker else " (no check cell calls ddplab.check." \
                                                          f"{mark.checker})"
            problems.append(f"{mark.where}: exercise {mark.checker!r}"
                            f"{f' cell {mark.cell!r}' if mark.cell else ''} not found{known}")
        for row in targets:
            row.covered[mark.kind].add((mark.test, mark.what) if mark.kind == "mistake" else mark.test)
    return rows, problems


def table(rows: list[Row]) -> str:
    """Per notebook: a line per exercise, a column per kind (count, or · where missing)."""
    lines, width = [], max([len(f"{r.checker} ({r.cell})") for r in rows] + [8])
    for notebook in sorted({r.notebook for r in rows}):
        lines.append(f"\n{notebook}")
        lines.append(f"  {'exercise':<{width}}  " + "  ".join(f"{k:>11}" for k in KINDS) + "  complete")
        for row in (r for r in rows if r.notebook == notebook):
            cells = [f"{len(row.covered[k])}/{NEEDED[k]}" if row.covered[k] else "·" for k in KINDS]
            done = "yes" if not row.missing() else "no"
            lines.append(f"  {f'{row.checker} ({row.cell})':<{width}}  "
                         + "  ".join(f"{c:>11}" for c in cells) + f"  {done}")
    complete = sum(not r.missing() for r in rows)
    lines.append(f"\n{len(rows)} exercises, {complete} complete, {len(rows) - complete} incomplete; "
                 + ", ".join(f"{sum(len(r.covered[k]) >= NEEDED[k] for r in rows)} with {k}" for k in KINDS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-incomplete", action="store_true",
                        help="exit 0 even where a row is incomplete (a bad mark still fails)")
    parser.add_argument("--notebook", help="only notebooks whose name starts with this (e.g. 01)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (notebooks/, tests/)")
    args = parser.parse_args(argv)
    rows, problems = matrix(args.root)
    if args.notebook:
        rows = [r for r in rows if r.notebook.startswith(args.notebook)]
    print(table(rows).lstrip("\n"))
    for problem in problems:
        print(f"exercise_matrix: {problem}", file=sys.stderr)
    incomplete = [r for r in rows if r.missing()]
    if incomplete and not args.allow_incomplete:
        print(f"exercise_matrix: {len(incomplete)} exercises lack a test kind (first: "
              f"{incomplete[0].checker} in {incomplete[0].notebook}: {', '.join(incomplete[0].missing())}). "
              f"Add the tests and mark them: @pytest.mark.exercise(\"{incomplete[0].checker}\", "
              f"\"{incomplete[0].missing()[0]}\") (docs/contributing.md).", file=sys.stderr)
    return 1 if problems or (incomplete and not args.allow_incomplete) else 0


if __name__ == "__main__":
    sys.exit(main())
