"""Every exercise section runs after a ``lab.restart()``: the notebook that shows it (issue 30).

The notebooks and their checkers tell a student who broke the lab to run
``lab.restart()`` and go on from the section they are in. A restart gives fresh
ranks: whatever an earlier section left on them is gone, while the kernel keeps
its names (the student ran those cells). A section (from a ``##`` or ``###``
heading to the next heading) that holds an exercise cell must therefore run on
fresh ranks.

``with_restarts`` turns a reference notebook into the one that proves it: a
``lab.restart()`` cell before every exercise section, after the lab was first
started. Where a notebook tells the student to rerun from an earlier cell
instead (05's DDP exercise: "rerun the cells from the data section's %%ranks
cell down"), copies of the cells from there to the section follow the restart,
as the student would rerun them: ``RESTART_FROM``. Where a section says nothing
above it is needed (05's ``Join`` exercise), nothing above it is rerun. Where a
notebook tells them to run its set-up cells on the ranks again after any
restart, copies of those come first: ``AFTER_RESTART``.

The suite does not execute that notebook on its own: ``ddplab grade`` grades it as
the "course-reference" student (tests/test_nbgrader.py), which runs the whole
course once anyway. So one execution proves both that the reference earns full
marks and that every section survives a restart: ``Grade.cells_failed`` lists any
other cell that failed. nbgrader's ``autograde`` grades four of them the same
way, and ``failures`` reads its autograded copy for any cell that raised. The
copies carry no nbgrader metadata (a grade id appears once) and ids of their own.
"""

from __future__ import annotations

import copy

import nbformat

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
#: the id prefix of every cell ``with_restarts`` adds.
ADDED = "restart-"


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


def _rerun(cell, n: int):
    """A copy of ``cell`` to run again: an id of its own, no outputs, no nbgrader metadata."""
    again = nbformat.v4.new_code_cell(cell.source, id=f"{ADDED}{n}-{cell.id}"[:64])
    tags = cell.metadata.get("tags", [])
    if tags:
        again.metadata["tags"] = list(tags)
    again.metadata["ddplab"] = {"rerun_of": cell.id}
    return again


def with_restarts(nb, name: str):
    """A copy of notebook ``nb`` (file name ``name``) with a restart before each exercise section."""
    out = copy.deepcopy(nb)
    points = restart_points(name, nb.cells)
    index = {cell.id: i for i, cell in enumerate(nb.cells)}
    cells, n = [], 0
    for i, cell in enumerate(nb.cells):
        if cell.id in points:
            n += 1
            restart = nbformat.v4.new_code_cell("lab.restart()", id=f"{ADDED}{n}")
            restart.metadata["ddplab"] = {"restart_before": cell.id}
            cells.append(restart)
            again = [nb.cells[index[c]] for c in AFTER_RESTART.get(name, [])]
            again += nb.cells[index[points[cell.id]]:i]         # what the notebook says to rerun
            cells += [_rerun(c, n) for c in again if c.cell_type == "code"]
        cells.append(copy.deepcopy(cell))
    out.cells = cells
    return out


def failures(nb) -> list[str]:
    """Each cell of an executed ``with_restarts`` notebook that raised, named with its section.

    A cell tagged ``raises-exception`` raises on purpose (it is the lesson), so it is not counted.
    """
    found, section = [], "(before the first heading)"
    for cell in nb.cells:
        section = heading(cell) or section
        if cell.cell_type != "code" or "raises-exception" in cell.metadata.get("tags", []):
            continue
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if errors:
            what = cell.metadata.get("ddplab", {})
            why = (f" (the restart before {what['restart_before']})" if "restart_before" in what
                   else f" (rerun of {what['rerun_of']} after a restart)" if "rerun_of" in what
                   else "")
            found.append(f"cell {cell.id}{why} in section {section!r}: "
                         f"{errors[0].ename}: {errors[0].evalue}"[:2000])
    return found
