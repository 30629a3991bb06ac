"""`ddplab release`: solution blocks become nbgrader's stub; a cell keeps its outputs only where the
student's own run of the copy prints them too (tests/test_nbgrader.py proves that against a run)."""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ddplab.course.release import (
    STUDENT_COPY,
    ReleaseError,
    graded,
    keeps_outputs,
    output_digest,
    release,
    release_notebook,
    strip_solutions,
)

ROOT = Path(__file__).resolve().parent.parent


def test_a_solution_block_becomes_the_stub_below_the_magic_line():
    source = "%%ranks\n### BEGIN SOLUTION\ntotal = torch.ones(1)\ndist.all_reduce(total)\n### END SOLUTION"
    assert strip_solutions(source) == "%%ranks\n# YOUR CODE HERE\nraise NotImplementedError()"


def test_the_stub_keeps_the_indentation_and_the_lines_around_it():
    source = ("def square(x):\n    y = x\n    ### BEGIN SOLUTION\n    return y * y\n"
              "    ### END SOLUTION\n\nprint('defined')")
    assert strip_solutions(source) == ("def square(x):\n    y = x\n    # YOUR CODE HERE\n"
                                       "    raise NotImplementedError()\n\nprint('defined')")


@pytest.mark.parametrize("source, words", [
    ("### BEGIN SOLUTION\nx = 1", ["no '### END SOLUTION'", "would be released"]),
    ("x = 1\n### END SOLUTION", ["line 2", "without '### BEGIN SOLUTION'"]),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", ["line 2", "second"]),
])
def test_unbalanced_markers_are_refused_with_the_line(source, words):
    with pytest.raises(ReleaseError) as info:
        strip_solutions(source, "01_x.ipynb, cell exercise-ring")
    message = str(info.value)
    assert "01_x.ipynb, cell exercise-ring" in message
    for word in words:
        assert word in message


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_course_notebook_releases_with_stubs_and_no_check_result():
    course = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    student = release_notebook(course, "00_setup.ipynb")
    by_id = {c.id: c for c in student.cells}
    exercise, check = by_id["exercise-mean-score"], by_id["check-mean-score"]
    assert "NotImplementedError" in exercise.source and "all_reduce" not in exercise.source
    assert exercise.outputs == [] and exercise.execution_count is None
    assert check.outputs == [] and check.execution_count is None
    assert exercise.metadata["tags"] == ["exercise"] and check.metadata["tags"] == ["check"]
    original = {c.id: c for c in course.cells}
    assert original["check-mean-score"].outputs != []           # the reference keeps what grading compares
    assert check.source == original["check-mean-score"].source
    # a demo the stub run prints alike keeps its outputs; the verdict's mark does not reach students
    assert by_id["cell-22"].outputs == original["cell-22"].outputs != []
    assert all(STUDENT_COPY not in c.metadata.get("ddplab", {}) for c in student.cells)
    assert "all_reduce" in original["exercise-mean-score"].source       # the course notebook untouched


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_released_copy_holds_no_check_result_and_only_outputs_its_stub_run_printed(path):
    """Issue 53: no `Correct:` before the student types anything, and no output of a cell the
    stub run (tools/clean_notebook.py --stub-run) did not print alike. Against the run itself:
    tests/test_nbgrader.py's round trip."""
    course = nbformat.read(path, as_version=4)
    student = release_notebook(course, path.name)
    assert "Correct" not in json.dumps([c.get("outputs", []) for c in student.cells])
    marks = {c.id: c.metadata.get("ddplab", {}).get(STUDENT_COPY) for c in course.cells}
    for cell in student.cells:
        if cell.cell_type != "code":
            continue
        if graded(cell):
            assert cell.outputs == [] and cell.execution_count is None, cell.id
        elif cell.outputs:
            assert marks[cell.id] == f"keep {output_digest(cell)}", cell.id
        else:
            assert cell.execution_count is None, cell.id
    # every other cell with outputs has the stub run's verdict, and a kept one still matches
    for cell in course.cells:
        if cell.cell_type == "code" and cell.outputs and not graded(cell):
            mark = marks[cell.id]
            assert mark is not None, (f"{path.name}, cell {cell.id}: outputs and no verdict of the stub run; "
                                      f"run tools/clean_notebook.py --stub-run {path}")
            assert mark == "clear" or mark == f"keep {output_digest(cell)}", \
                (f"{path.name}, cell {cell.id}: its outputs changed since the stub run; run "
                 f"tools/clean_notebook.py --stub-run {path}, or the student copy loses them")


def _cell(source="print(1)", cell_id="demo", outputs=None, **metadata):
    cell = nbformat.v4.new_code_cell(source, id=cell_id, metadata=metadata, execution_count=3)
    cell.outputs = outputs if outputs is not None else [nbformat.v4.new_output(
        "stream", name="stdout", text="the ranks agree: 0.52 s\n")]
    return cell


def test_a_cell_keeps_its_outputs_only_while_they_are_what_the_stub_run_printed():
    cell = _cell()
    assert not keeps_outputs(cell)                                  # no verdict: cleared
    cell.metadata["ddplab"] = {STUDENT_COPY: f"keep {output_digest(cell)}"}
    assert keeps_outputs(cell)
    cell.outputs[0].text = "the ranks agree: 1.5 s\n"               # sanitized alike (a time)
    assert keeps_outputs(cell)
    cell.outputs[0].text = "the ranks disagree\n"                   # re-executed since: cleared
    assert not keeps_outputs(cell)
    cell.metadata["ddplab"] = {STUDENT_COPY: "clear"}
    assert not keeps_outputs(cell)
    check = _cell("ddplab.check.x()", "check-x", tags=["check"])
    check.metadata["ddplab"] = {STUDENT_COPY: f"keep {output_digest(check)}"}
    assert not keeps_outputs(check)                                 # a check never keeps its line
    ignored = _cell("# NBVAL_IGNORE_OUTPUT\nprint(busbw)")
    ignored.metadata["ddplab"] = {STUDENT_COPY: f"keep {output_digest(ignored)}"}
    ignored.outputs[0].text = "the ranks agree: 7.25 s\n"           # only digits differ: nbval ignores it
    assert keeps_outputs(ignored)
    picture = _cell(outputs=[nbformat.v4.new_output("display_data", data={"image/png": "AAAA"})])
    assert output_digest(picture) != output_digest(_cell(outputs=[]))   # a picture is not nothing


def test_the_timeline_exercises_answer_is_not_in_the_copy():
    """01's who-waited check line named the answer ('send on rank 0 waited longest')."""
    course = nbformat.read(ROOT / "notebooks" / "01_point_to_point.ipynb", as_version=4)
    answer = next(c for c in course.cells if c.id == "check-who-waited").outputs[0].text
    assert "waited" in answer
    text = nbformat.writes(release_notebook(course, "01_point_to_point.ipynb"))
    assert answer.strip() not in text and "Correct" not in text


def test_a_student_copy_given_as_the_reference_stops_grading(tmp_path):
    """Grading compares with the reference's check outputs; a copy has none to compare with."""
    from ddplab.errors import GradeError
    from ddplab.grade.plan import check_reference

    course = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    nbformat.write(release_notebook(course, "00_setup.ipynb"), tmp_path / "00_setup.ipynb")
    with pytest.raises(GradeError, match="check cell check-mean-score .* has no stored output"):
        check_reference(tmp_path / "00_setup.ipynb")


def test_a_copy_made_before_the_names_were_hyphenated_is_still_graded_exercise_by_exercise():
    """A workspace copy from before issue 53 has `exercise-global_mean`, `check-global_mean`:
    grading matches its check cells by tag and source, its exercise cells by position."""
    from ddplab.grade.plan import exercises, plan

    course = nbformat.read(ROOT / "notebooks" / "05_ddp_training.ipynb", as_version=4)
    old = release_notebook(course, "05_ddp_training.ipynb")
    renamed = 0
    for cell in old.cells:
        if cell.id.startswith(("exercise-", "check-")) and cell.id.count("-") > 1:
            prefix, name = cell.id.split("-", 1)
            cell.id, renamed = f"{prefix}-{name.replace('-', '_')}", renamed + 1
    assert renamed >= 10
    steps, problems = plan(old, exercises(course))
    assert problems == {}
    assert sorted(s.name for s in steps if s.role == "check") == sorted(e.name for e in exercises(course))


def test_nbgraders_steps_are_its_own_with_clear_output_replaced_by_ddplabs():
    """ddplab.course.nbgrader_release names nbgrader's generate_assignment steps by path (ddplab
    never imports nbgrader); they must be this nbgrader's own, ClearOutput swapped for ours.
    tests/test_nbgrader.py runs generate_assignment with them on the whole course."""
    from nbgrader.converters import GenerateAssignment
    from traitlets.utils.importstring import import_item

    from ddplab.course.nbgrader_release import PREPROCESSORS, StudentOutputs

    theirs = GenerateAssignment.class_traits()["preprocessors"].default()
    ours = [import_item(path) for path in PREPROCESSORS]
    assert [StudentOutputs if step.__name__ == "ClearOutput" else step for step in theirs] == ours


def test_solution_markers_in_a_markdown_cell_are_refused_not_released():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell("The answer:\n### BEGIN SOLUTION\n42\n### END SOLUTION",
                                                  id="answer"))
    with pytest.raises(ReleaseError, match="x.ipynb, cell answer is a markdown cell with a solution marker"):
        release_notebook(nb, "x.ipynb")
    nb.cells[0].source = "Solutions sit between `### BEGIN SOLUTION` and `### END SOLUTION`."
    assert release_notebook(nb, "x.ipynb").cells[0].source == nb.cells[0].source   # text about them


def test_an_exercise_cell_without_markers_is_refused():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("total = 10", id="exercise-mean-score",
                                              metadata={"tags": ["exercise"]}))
    with pytest.raises(ReleaseError, match="tagged 'exercise' but has no"):
        release_notebook(nb, "x.ipynb")


@pytest.mark.slow
def test_the_command_writes_one_student_notebook_per_course_notebook(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ddplab.course.cli", "release",
                             str(ROOT / "notebooks"), "-o", str(tmp_path / "release")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    written = sorted(p.name for p in (tmp_path / "release").glob("*.ipynb"))
    assert written == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert f"released {tmp_path / 'release' / '00_setup.ipynb'}" in result.stdout
    nbformat.validate(nbformat.read(tmp_path / "release" / "00_setup.ipynb", as_version=4))


@pytest.mark.slow
def test_a_bad_notebook_stops_the_release_before_anything_is_written(tmp_path):
    good = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    bad = nbformat.v4.new_notebook()
    bad.cells.append(nbformat.v4.new_code_cell("### BEGIN SOLUTION\nanswer = 42", id="exercise-x"))
    (tmp_path / "course").mkdir()
    nbformat.write(good, tmp_path / "course" / "00_setup.ipynb")
    nbformat.write(bad, tmp_path / "course" / "01_bad.ipynb")
    with pytest.raises(ReleaseError, match="01_bad.ipynb, cell exercise-x"):
        release([tmp_path / "course"], tmp_path / "release")
    assert not (tmp_path / "release").exists()
    result = subprocess.run([sys.executable, "-m", "ddplab.course.cli", "release", str(tmp_path / "course"),
                             "-o", str(tmp_path / "release")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "would be released" in result.stderr


def test_release_refuses_to_write_over_its_input_or_any_reference(tmp_path):
    course = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    nbformat.write(course, tmp_path / "00_setup.ipynb")
    before = (tmp_path / "00_setup.ipynb").read_bytes()
    result = subprocess.run([sys.executable, "-m", "ddplab.course.cli", "release",
                             str(tmp_path / "00_setup.ipynb"), "-o", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "would destroy its solutions" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "00_setup.ipynb").read_bytes() == before
    # a reference copy already in the output folder is not overwritten either
    (tmp_path / "course").mkdir()
    nbformat.write(course, tmp_path / "course" / "00_setup.ipynb")
    with pytest.raises(ReleaseError, match="already holds a notebook with solutions"):
        release([tmp_path / "course" / "00_setup.ipynb"], tmp_path)
    assert (tmp_path / "00_setup.ipynb").read_bytes() == before
