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

With ``--stub-run`` it also runs each notebook's student version (every
solution a stub) through ``ddplab grade``, as the suite's round trip does, and
records in each code cell whether the student version keeps its outputs: only
where that run printed the same (``ddplab.course.release``). Run it after
re-executing a notebook whose outputs changed; it takes one run of the
notebook, several notebooks side by side.

    python tools/clean_notebook.py notebooks/*.ipynb
    python tools/clean_notebook.py --stub-run notebooks/12_build_ddp_zero_fsdp.ipynb
    python tools/clean_notebook.py --stub-run --runs 3 notebooks/09_debugging.ipynb   # a flaky demo
"""

import argparse
import tempfile
from pathlib import Path

import nbformat

KEEP_CELL_METADATA = {"tags", "editable", "deletable", "nbgrader", "ddplab"}
GRADED_ID_PREFIXES = ("exercise-", "check-")
NBGRADER_SCHEMA = 3
#: Per cell while the stub run executes: nbval's timeout in make test.
STUB_CELL_TIMEOUT = 300


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


def stub_run(paths: list[str], jobs: int = 2, runs: int = 1) -> None:
    """Grade each notebook's student version against it; record which outputs the copy keeps.

    With ``runs`` > 1 the student version runs that many times (as that many students,
    side by side), and a cell is kept only where every run printed the reference's outputs:
    a demo that a student's run prints only sometimes is cleared.

    A stub must fail fast (raise): were an exercise lost to a hang, a timeout or a dead
    kernel, ``ddplab grade`` would go on from the reference solution, not from what a
    student's run leaves, so such a run records nothing and says so.
    """
    from ddplab.course.release import record_stub_run, release_notebook
    from ddplab.grade.class_run import grade

    by_name = {path.name: path for path in map(Path, paths)}
    graded = []
    with tempfile.TemporaryDirectory(prefix="stub-run-") as tmp:
        for folder in sorted({p.parent for p in by_name.values()}):
            mine = []
            for path in (p for p in by_name.values() if p.parent == folder):
                released = release_notebook(nbformat.read(path, as_version=4), path.name)
                for run in range(runs):
                    student = Path(tmp) / folder.name / f"stub{run}"
                    student.mkdir(parents=True, exist_ok=True)
                    nbformat.write(released, student / path.name)
                    mine.append(student / path.name)
            graded += grade(mine, folder, jobs=jobs, cell_timeout=STUB_CELL_TIMEOUT)
    for name, path in by_name.items():
        results = [r for r in graded if Path(r.path).name == name]
        broke = [f"{m.exercise}: {m.reason}" for r in results for m in r.marks if _broke_the_lab(m.reason)]
        broke += [f for r in results for f in r.cells_failed if _broke_the_lab(f)]
        error = next((r.error for r in results if r.error), "")
        if error or broke:
            why = error or ("broke its lab, so ddplab grade went on from the reference "
                            "solution: " + "; ".join(broke)[:400])
            print(f"{path}: not recorded: the stub run {why}")
            continue
        first, *others = [r.cell_digests for r in results]
        agreed = {cell: digest for cell, digest in first.items()
                  if all(other.get(cell) == digest for other in others)}
        nb = nbformat.read(path, as_version=4)
        verdicts = record_stub_run(nb, agreed)
        nbformat.write(nb, path)
        print(f"{path}: the student version keeps the outputs of {len(verdicts['kept'])} cells, "
              f"clears {len(verdicts['cleared'])}: {', '.join(verdicts['cleared']) or 'none'}")


def _broke_the_lab(reason: str) -> bool:
    """Whether a grade's reason says the kernel or lab was recovered by a replay
    (``ddplab.grade.run``): a hang, a cell timeout, a dead kernel, cells not run."""
    return any(words in reason for words in ("HangError", "timed out after", "the kernel died",
                                              ": timeout: ", ": died: ", "not run"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--stub-run", action="store_true",
                        help="also run each student version and record which outputs it keeps")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks run at once (--stub-run)")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs of each student version; a cell is kept only if all agree")
    args = parser.parse_args()
    for path in args.notebooks:
        clean(path)
    if args.stub_run:
        stub_run(args.notebooks, args.jobs, args.runs)
