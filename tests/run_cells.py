"""Run a notebook's cells up to a given cell, in a kernel of the Python that runs this script.

tests/test_wheel.py runs it with the Python of a fresh virtual environment that holds only
what ``pip install ddplab-<version>.whl`` put there, so the kernel is that environment's,
as a student's kernel in Colab, Kaggle or a JupyterHub is theirs:

    python run_cells.py NOTEBOOK STOP_ID OUT

runs every cell of NOTEBOOK before the cell whose id is STOP_ID (all of them if no cell has
it), then one cell of its own that prints the kernel's Python and the ddplab it imported,
then ``lab.stop()``, and writes the executed cells to OUT. A cell's error does not stop the
run: it is in OUT, for the test to show. Only the standard library and ddplab's own
dependencies (nbformat, nbclient) are used: nothing from the checkout.
"""

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

#: What the last cell prints: the kernel's interpreter, and where ddplab came from.
PROBE = "import sys\nprint(sys.executable)\nprint(ddplab.__file__)\nlab.stop()"


def main(notebook: str, stop_id: str, out: str) -> None:
    nb = nbformat.read(notebook, as_version=4)
    cells = []
    for cell in nb.cells:
        if cell.get("id") == stop_id:
            break
        cells.append(cell)
    nb.cells = cells + [nbformat.v4.new_code_cell(PROBE)]
    # The kernel named python3 here is this interpreter's (ipykernel's own spec: jupyter_client
    # starts it with sys.executable); the probe cell shows it.
    client = NotebookClient(nb, kernel_name="python3", timeout=300, allow_errors=True,
                            resources={"metadata": {"path": str(Path(notebook).parent)}})
    client.execute()
    nbformat.write(nb, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
