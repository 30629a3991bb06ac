"""Grades for a spreadsheet or an LMS gradebook: cells a spreadsheet cannot run, and Canvas's import.

``spreadsheet_cell``: a hand-in folder's name is chosen by a student, and a
cell that begins with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return
is a formula to Excel, LibreOffice and Google Sheets (``=cmd|' /C calc'!A0``).
Following OWASP's rule for CSV injection, such a cell is written with a
single quote in front, which those programs show as text; ``report.to_csv``
and ``to_canvas`` write every text cell through it.

``to_canvas``: the gradebook CSV Canvas imports (Grades > Import), in the
shape its importer reads (canvas-lms ``app/models/gradebook_importer.rb``):
the header ``Student, ID, SIS User ID, SIS Login ID, Section``, then a column
per assignment; a second row whose first cell is ``Points Possible``; then a
row per student. Canvas finds each row's student by ``ID`` (its own user id),
else by ``SIS User ID``, else by ``SIS Login ID``, else by the name in
``Student``; a row it cannot match is shown as an unknown student for the
instructor to resolve. Without a roster, ddplab writes the hand-in folder's
name as ``Student`` and ``SIS Login ID`` (name the folders by login) and the
student's section folder as ``Section``, and leaves ``ID`` and ``SIS User ID``
empty. With a roster (``--roster``: the CSV Canvas exports from Grades >
Export, or any CSV with those five columns), each folder is matched to a
row of it by SIS Login ID (or the part of it before ``@``), SIS User ID or ID,
and that row's five cells are written: every student is matched by ID.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from ..errors import GradeError

#: The columns a Canvas gradebook import starts with, in its order.
CANVAS_IDENTITY = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
#: What makes a spreadsheet read a cell as a formula (OWASP, "CSV Injection").
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(value):
    """``value``, made safe for a spreadsheet: text that would start a formula gets a ``'``."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def write_rows(rows: list[list]) -> str:
    """CSV text of ``rows``, every text cell through ``spreadsheet_cell``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerows([spreadsheet_cell(value) for value in row] for row in rows)
    return out.getvalue()


@dataclass(frozen=True)
class Person:
    """One student of a roster: the five cells Canvas identifies a student by."""
    name: str
    id: str
    sis_user_id: str
    sis_login_id: str
    section: str


class Roster:
    """A course's students, read from Canvas's gradebook export; ``find`` matches a folder name."""

    def __init__(self, people: list[Person], path: Path | None = None) -> None:
        self.people, self.path = people, path
        self._keys: dict[str, list[Person]] = {}
        for person in people:
            login = person.sis_login_id.casefold()
            keys = {login, login.split("@")[0], person.sis_user_id.casefold(), person.id.casefold()}
            for k in keys - {""}:
                self._keys.setdefault(k, []).append(person)

    @classmethod
    def read(cls, path: str | Path) -> Roster:
        """The roster in ``path``; GradeError naming the fix if it is not one."""
        path = Path(path)
        try:
            rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8-sig"))))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise GradeError(f"ddplab grade: --roster {path} cannot be read ({e}). Give the CSV "
                             f"Canvas exports from Grades > Export.") from e
        head = [h.strip() for h in rows[0]] if rows else []
        missing = [c for c in CANVAS_IDENTITY if c not in head]
        if missing:
            raise GradeError(f"ddplab grade: --roster {path} has no column {missing[0]!r}; a roster "
                             f"needs the columns {', '.join(CANVAS_IDENTITY)} (Canvas's Grades > "
                             f"Export writes them).")
        at = [head.index(c) for c in CANVAS_IDENTITY]
        people = [Person(*(row[i].strip() if i < len(row) else "" for i in at)) for row in rows[1:]
                  if row and "Points Possible" not in row[0] and any(cell.strip() for cell in row)]
        return cls(people, path)

    def find(self, student: str) -> Person | None:
        """The one person whose SIS Login ID (or its part before ``@``), SIS User ID or ID is
        ``student`` (case aside); None if none is, or more than one."""
        found = self._keys.get(student.casefold(), [])
        return found[0] if len(set(found)) == 1 else None


def to_canvas(grades, roster: Roster | None = None) -> str:
    """A gradebook CSV for Canvas's import: one row per student, one column of points per notebook.

    A student is one hand-in folder (``Grade.section`` and ``Grade.student``):
    two students are two rows even when named alike, and each notebook's cell is
    its one graded copy's score (a second copy never replaces it: ``handin``).
    """
    notebooks = list(dict.fromkeys(g.notebook for g in grades))
    possible = {nb: max((len(g.marks) for g in grades if g.notebook == nb), default=0)
                for nb in notebooks}
    rows: list[list] = [[*CANVAS_IDENTITY, *notebooks],
                        ["Points Possible", "", "", "", "", *(possible[nb] for nb in notebooks)]]
    for who in dict.fromkeys((g.section, g.student) for g in grades):
        mine = [g for g in grades if (g.section, g.student) == who]
        scores = {g.notebook: (0 if g.error else g.score) for g in mine}
        person = roster.find(who[1]) if roster is not None else None
        identity = ([person.name, person.id, person.sis_user_id, person.sis_login_id, person.section]
                    if person is not None else [who[1], "", "", who[1], who[0]])
        rows.append([*identity, *(scores.get(nb, "") for nb in notebooks)])
    return write_rows(rows)


def roster_warnings(grades, roster: Roster) -> list[str]:
    """What the roster leaves unresolved: students it does not name (Canvas cannot match their
    rows), and people two folders matched (Canvas would keep one row of the two)."""
    said, taken = [], {}
    for who in dict.fromkeys((g.section, g.student) for g in grades):
        person = roster.find(who[1])
        shown = "/".join(filter(None, who))
        if person is None:
            said.append(f"{shown} is not in the roster {roster.path}: its Canvas row has no ID")
        elif taken.setdefault(person, shown) != shown:
            said.append(f"{shown} and {taken[person]} are both {person.sis_login_id or person.name} "
                        f"in the roster: Canvas would keep one of their rows")
    return said
