"""No hidden dependencies: every exercise section runs after a ``lab.restart()`` (issue 30).

The notebooks and their checkers tell a student who broke the lab to run
``lab.restart()`` and go on from the section they are in. A restart gives fresh
ranks: whatever an earlier section left on them is gone, while the kernel keeps
its names (the student ran those cells). So, for every notebook, one kernel runs
the whole notebook with its reference answers, in order, and restarts the lab
before each exercise section: a section (from a ``##`` or ``###`` heading to the
next heading) holding an exercise cell. A section that leans on what an earlier
one left on the ranks fails here, naming the cell.

Where a notebook tells the student to rerun from an earlier cell instead (05's
DDP exercise: "rerun the cells from the data section's %%ranks cell down"),
the cells from there to the section are run again after the restart, as the
student would: ``RESTART_FROM``. Where a section says nothing above it is
needed (05's ``Join`` exercise), nothing above it is rerun. Where a notebook
tells them to run its set-up cell on the ranks again after any restart, that
cell runs first: ``AFTER_RESTART``.

One kernel per notebook, not one per section: a restart costs seconds, a new
kernel and lab many more.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from ddplab.grade.run import Kernel

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
#: notebook -> {first cell of an exercise section: the cell the notebook says to rerun from}.
RESTART_FROM: dict[str, dict[str, str]] = {
    # Its opening cell says so; not for cell-72 (Join), whose text says to rerun only its exercise
    # cell, since the check makes its own model: so that section reruns nothing before it.
    "05_ddp_training.ipynb": {section: "cell-07" for section in
                              ("cell-20", "cell-34", "cell-48", "cell-51", "cell-62")},
    "10_checkpoints_and_failures.ipynb": {"cell-32": "cell-29"},        # cell-32 says so
}
#: notebook -> the set-up cells it says to run again after every lab.restart() (see its set-up text).
AFTER_RESTART: dict[str, list[str]] = {
    "04_sampler_sharding.ipynb": ["cell-03", "cell-06", "cell-09"],
    "08_sharding_the_model.ipynb": ["cell-02"],
}
CELL_TIMEOUT = 300


def heading(cell) -> str:
    """The first ``##``/``###`` heading of a markdown cell ("" if none)."""
    if cell.cell_type != "markdown":
        return ""
    return next((line.strip() for line in cell.source.splitlines()
                 if line.startswith(("## ", "### "))), "")


def sections(cells: list) -> list[tuple[str, list]]:
    """The notebook cut at its headings: (heading, cells), the cells before the first one first."""
    out: list[tuple[str, list]] = [("(before the first heading)", [])]
    for cell in cells:
        title = heading(cell)
        if title:
            out.append((title, []))
        out[-1][1].append(cell)
    return out


def restart_points(name: str, cells: list) -> dict[str, str]:
    """{id of a cell before which the lab is restarted: the id of the cell to rerun from}."""
    points, lab_started = {}, False
    moved = RESTART_FROM.get(name, {})
    for _, members in sections(cells):
        if lab_started and any(c.get("id", "").startswith("exercise-") for c in members):
            first = members[0].id
            points[first] = moved.get(first, first)
        lab_started = lab_started or any("ddplab.start(" in c.source for c in members
                                         if c.cell_type == "code")
    return points


def _error_text(outputs: list) -> str:
    errors = [o for o in outputs if o.output_type == "error"]
    if errors:
        return f"{errors[0].ename}: {errors[0].evalue}"[:3000]
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")[-3000:]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_exercise_section_runs_after_a_restart(name):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    points = restart_points(name, nb.cells)
    titles = {members[0].id: title for title, members in sections(nb.cells) if members}
    kernel = Kernel(str(ROOT / "notebooks"), CELL_TIMEOUT)
    index = {cell.id: i for i, cell in enumerate(nb.cells)}
    restarted, section = 0, "(before the first heading)"

    def run(cell, why: str) -> None:
        status, outputs, reason = kernel.run(cell.source)
        if status == "error" and "raises-exception" in cell.metadata.get("tags", []):
            return
        assert status == "ok", (f"{name}: cell {cell.id} in section {section!r} failed {why} "
                                f"({reason}):\n{_error_text(outputs)}")

    try:
        for i, cell in enumerate(nb.cells):
            section = titles.get(cell.id, section)
            if cell.id in points:
                status, outputs, _ = kernel.run("lab.restart()")
                assert status == "ok", f"{name}: lab.restart() before {cell.id} failed: " \
                                       f"{_error_text(outputs)}"
                restarted += 1
                for again in AFTER_RESTART.get(name, []):
                    run(nb.cells[index[again]], f"when rerun after a lab.restart() for section "
                                                f"{section!r}")
                for again in nb.cells[index[points[cell.id]]:i]:     # what the notebook says to rerun
                    if again.cell_type == "code":
                        run(again, f"when rerun after a lab.restart() for section {section!r}")
            if cell.cell_type == "code":
                run(cell, "after the lab was restarted before its exercise section (or an "
                          "earlier one)")
    finally:
        kernel.stop()
    assert restarted == len(points)
