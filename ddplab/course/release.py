"""``ddplab release``: the student versions of the course notebooks.

A course notebook holds the solutions, between two marker lines::

    %%ranks
    ### BEGIN SOLUTION
    total = torch.tensor([10.0 * rank])
    dist.all_reduce(total)
    ### END SOLUTION

The student version replaces each block, markers included, by nbgrader's stub
(so courses that use nbgrader can take the notebooks as they are)::

    %%ranks
    # YOUR CODE HERE
    raise NotImplementedError()

and holds no output that the student's own run would not print. The rule:
a code cell keeps its outputs only if a run of the student version itself,
every solution a stub, printed the same (compared as nbval compares, by
``ddplab.grade.compare.digest``). ``tools/clean_notebook.py --stub-run`` makes
that run (``ddplab grade`` of the released copy) and records the verdict in
each code cell's metadata, ``{"ddplab": {"student_copy": "keep <digest>"}}``
or ``"clear"``; a cell kept only while its outputs still have that digest, so
an output that changed since (a notebook re-executed) is cleared until the
tool runs again. Exercise and check cells are always cleared: a check's
``Correct: ...`` is never what a stub earns. So demos keep their pictures,
while check results, anything computed from a solution, and the execution
counts of cleared cells go. Grading never reads the student version's
outputs: ``ddplab grade`` and nbval compare with the reference notebook's.

Cell ids and tags are kept, since grading finds the exercise and check cells
by them. ``ddplab notebooks`` (the workspace ``make lab`` opens), ``ddplab
release`` and nbgrader's ``generate_assignment`` (configured with
``ddplab.course.nbgrader``) make the student version here, cell by cell with
``student_cell``.

    ddplab release notebooks/ -o release/
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import nbformat

from ..errors import ReleaseError
from ..grade.compare import digest, sanitize_patterns, values_compared
from ..grade.plan import notebooks_in
from ..hints import BEGIN, END

STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
#: The key, in a code cell's ``ddplab`` metadata, of the stub run's verdict on its outputs.
STUDENT_COPY = "student_copy"


def strip_solutions(source: str, where: str = "cell") -> str:
    """``source`` with every solution block replaced by the stub, at the block's indentation.

    Raises ``ReleaseError`` naming ``where`` if a block is opened and not
    closed, or closed and not opened: releasing it would leak the solution.
    """
    lines, inside, indent = [], False, ""
    for number, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ReleaseError(f"ddplab release: {where} line {number} opens a second "
                                   f"'{BEGIN}' before '{END}'. Close each block before the next.")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            lines += [indent + stub for stub in STUB]
        elif marker == END:
            if not inside:
                raise ReleaseError(f"ddplab release: {where} line {number} has '{END}' without "
                                   f"'{BEGIN}' above it. Add the opening marker.")
            inside = False
        elif not inside:
            lines.append(line)
    if inside:
        raise ReleaseError(f"ddplab release: {where} has '{BEGIN}' but no '{END}', so the "
                           f"solution would be released. Add '{END}' after the solution.")
    return "\n".join(lines)


def has_solution(cell) -> bool:
    return cell.cell_type == "code" and any(line.strip() == BEGIN
                                            for line in cell.source.splitlines())


def graded(cell) -> bool:
    """Whether ``cell`` is an exercise or a check (by id or tag): its outputs never go to a student."""
    tags = cell.metadata.get("tags", [])
    return (cell.get("id", "").startswith(("exercise-", "check-"))
            or "exercise" in tags or "check" in tags)


@lru_cache(maxsize=1)
def _patterns() -> tuple:
    return tuple(sanitize_patterns())


def output_digest(cell) -> str:
    """``digest`` of a code cell's outputs (without values for a cell nbval does not compare)."""
    return digest(cell.get("outputs", []), _patterns(), values_compared(cell))


def keeps_outputs(cell) -> bool:
    """Whether the student version keeps this cell's outputs: the stub run printed them too."""
    if cell.cell_type != "code" or not cell.get("outputs") or graded(cell) or has_solution(cell):
        return False
    return cell.metadata.get("ddplab", {}).get(STUDENT_COPY) == f"keep {output_digest(cell)}"


def student_cell(cell) -> None:
    """Make code ``cell`` (its source already stubbed) what the student version holds, in place:
    outputs and execution count cleared unless ``keeps_outputs``; the verdict's mark dropped."""
    if cell.cell_type != "code":
        return
    if not keeps_outputs(cell):
        cell.outputs, cell.execution_count = [], None
    own = cell.metadata.get("ddplab")
    if own is not None:
        own.pop(STUDENT_COPY, None)
        if not own:
            del cell.metadata["ddplab"]


def record_stub_run(nb, digests: dict[str, str]) -> dict[str, list[str]]:
    """Write each code cell's verdict into reference notebook ``nb``, from the stub run's
    ``digests`` (cell id -> ``digest`` of what it printed there); return the ids kept and cleared.

    A cell missing from ``digests`` (the run never reached it) is cleared.
    """
    verdicts: dict[str, list[str]] = {"kept": [], "cleared": []}
    for cell in nb.cells:
        own = cell.metadata.get("ddplab", {})
        own.pop(STUDENT_COPY, None)
        if cell.cell_type == "code" and cell.get("outputs") and not graded(cell):
            mine = output_digest(cell)
            keep = digests.get(cell.get("id")) == mine
            own[STUDENT_COPY] = f"keep {mine}" if keep else "clear"
            verdicts["kept" if keep else "cleared"].append(cell.get("id"))
        if own:
            cell.metadata["ddplab"] = own
        else:
            cell.metadata.pop("ddplab", None)
    return verdicts


def release_notebook(nb, name: str = "notebook"):
    """The student version of notebook ``nb`` (a new object; ``nb`` is not changed)."""
    student = nbformat.from_dict(nb)   # a deep copy
    for index, cell in enumerate(student.cells):
        where = f"{name}, cell {cell.get('id', index)}"
        if cell.cell_type != "code":
            if any(line.strip() in (BEGIN, END) for line in cell.source.splitlines()):
                # Only code cells are stubbed: the text between the markers would reach
                # every student as it is.
                raise ReleaseError(f"ddplab release: {where} is a {cell.cell_type} cell with a "
                                   f"solution marker; only code cells are stubbed, so students would "
                                   f"get its text. Move the solution into a code cell, or write the "
                                   f"markers differently (e.g. in backquotes) if the text is about them.")
            continue
        if has_solution(cell):
            cell.source = strip_solutions(cell.source, where)
            cell.outputs, cell.execution_count = [], None      # whatever its tags: a solution's
        elif "exercise" in cell.metadata.get("tags", []):
            raise ReleaseError(f"ddplab release: {where} is tagged 'exercise' but has no "
                               f"'{BEGIN}' / '{END}' block, so students would get the answer. "
                               f"Put the solution between the markers.")
        else:
            strip_solutions(cell.source, where)    # a stray END marker is a mistake too
        student_cell(cell)
    return student


def read_notebook(path: Path, error: type[Exception]):
    """The notebook at ``path``; ``error`` naming the path and the fix if it is not one."""
    try:
        return nbformat.read(path, as_version=4)
    except Exception as e:        # not JSON, not a notebook, unreadable
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(f"ddplab: {path} is not a readable notebook ({reason[:120]}). Fix or "
                    f"replace the file (re-save it from Jupyter, or restore it from git).") from e


def _refuse_overwriting_sources(sources: list[Path], out_dir: Path) -> None:
    """ReleaseError if a student version would be written over a course notebook.

    ``ddplab release 00_setup.ipynb -o .`` would replace the reference (the
    solutions, and the check outputs grading compares with) by the student
    version. A notebook that holds solutions is a reference too, even one not
    named on the command line.
    """
    inputs = {p.resolve() for p in sources}
    for path in sources:
        target = (out_dir / path.name).resolve()
        if target in inputs:
            raise ReleaseError(f"ddplab release: {out_dir / path.name} is the course notebook "
                               f"being released; writing the student version there would "
                               f"destroy its solutions. Choose another folder with -o.")
        if target.is_file() and _holds_solutions(target):
            raise ReleaseError(f"ddplab release: {target} already holds a notebook with "
                               f"solutions (a reference); it is never overwritten. Choose "
                               f"another folder with -o, or remove that file yourself.")


def _holds_solutions(path: Path) -> bool:
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:
        return False          # not a notebook: nothing of the course's to lose
    return any(has_solution(cell) for cell in nb.cells)


def release(paths: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the student version of each notebook into ``out_dir``; return the files written.

    Every notebook is checked before any file is written, so a mistake in one
    never leaves a half-released course.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ReleaseError(f"ddplab release: -o {out_dir} is a file; -o names the folder the "
                           f"student versions go to. Name a folder (it is made if it does not exist).")
    sources = notebooks_in(paths)
    if not sources:
        raise FileNotFoundError(f"ddplab release: no notebooks in {', '.join(map(str, paths))}.")
    names = [p.name for p in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ReleaseError(f"ddplab release: two notebooks are named {twice[0]}; released "
                           f"notebooks share one folder, so give them different names.")
    _refuse_overwriting_sources(sources, out_dir)
    students = [release_notebook(read_notebook(p, ReleaseError), p.name) for p in sources]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReleaseError(f"ddplab release: -o {out_dir} cannot be made ({e.strerror}). Name a "
                           f"folder you can write to.") from e
    written = []
    for path, nb in zip(sources, students):
        target = out_dir / path.name
        nbformat.write(nb, target)
        written.append(target)
    return written
