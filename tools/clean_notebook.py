"""Keep committed notebooks clean: outputs stay (nbval compares them), noise goes.

Removes per-cell execution timestamps and volatile metadata, and gives every
cell a stable id, so re-running a notebook changes git only where output did.

Exercise and check cells keep the ids their author gave them
(``exercise-<name>``, ``check-<name>``, tagged ``exercise`` / ``check``):
grading finds them by id, so they must not move when a cell is inserted above.

    python tools/clean_notebook.py notebooks/*.ipynb
"""

import sys

import nbformat

KEEP_CELL_METADATA = {"tags", "editable", "deletable"}
GRADED_ID_PREFIXES = ("exercise-", "check-")


def clean(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"},
                   "language_info": {"name": "python"}}
    for index, cell in enumerate(nb.cells):
        if not cell.get("id", "").startswith(GRADED_ID_PREFIXES):
            cell.id = f"cell-{index:02d}"
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
    nbformat.write(nb, path)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        clean(path)
