"""Keep committed notebooks clean: outputs stay (nbval compares them), noise goes.

Removes per-cell execution timestamps, volatile metadata and the emptied live
output areas of long ddplab cells, and gives every
cell a stable id, so re-running a notebook changes git only where output did.

Exercise and check cells keep the ids their author gave them
(``exercise-<name>``, ``check-<name>``, tagged ``exercise`` / ``check``):
grading finds them by id, so they must not move when a cell is inserted above.
From those ids and tags it writes nbgrader's cell metadata, so a course that
uses nbgrader takes the notebooks as they are: an exercise cell is a solution
cell and a check cell an autograded, locked test cell worth one point (as in
``ddplab grade``), each with ``grade_id`` = its cell id. Every other cell
loses any nbgrader metadata. A hint for an exercise stays in its cell's
``{"ddplab": {"hint": ...}}`` metadata (``ddplab.hint``).

    python tools/clean_notebook.py notebooks/*.ipynb
"""

import sys

import nbformat

KEEP_CELL_METADATA = {"tags", "editable", "deletable", "nbgrader", "ddplab"}
GRADED_ID_PREFIXES = ("exercise-", "check-")
NBGRADER_SCHEMA = 3


def nbgrader_metadata(cell) -> dict | None:
    """nbgrader's metadata for an exercise or check cell (by id and tag); None for any other."""
    cell_id, tags = cell.get("id", ""), cell.metadata.get("tags", [])
    if cell.cell_type != "code":
        return None
    common = {"grade_id": cell_id, "schema_version": NBGRADER_SCHEMA, "task": False}
    if cell_id.startswith("exercise-") and "exercise" in tags:
        return {**common, "solution": True, "grade": False, "locked": False}
    if cell_id.startswith("check-") and "check" in tags:
        return {**common, "solution": False, "grade": True, "locked": True, "points": 1}
    return None


def clean(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"},
                   "language_info": {"name": "python"}}
    for index, cell in enumerate(nb.cells):
        if not cell.get("id", "").startswith(GRADED_ID_PREFIXES):
            cell.id = f"cell-{index:02d}"
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        graded = nbgrader_metadata(cell)
        cell.metadata.pop("nbgrader", None)
        if graded:
            cell.metadata["nbgrader"] = graded
        if "outputs" in cell:
            # ddplab's live output areas end empty (see ddplab.lab.live): not output.
            cell.outputs = [o for o in cell.outputs
                            if not (o.output_type == "display_data" and not o.get("data"))]
    nbformat.write(nb, path)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        clean(path)
