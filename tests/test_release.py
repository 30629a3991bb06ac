"""`ddplab release`: solution blocks become nbgrader's stub; check cells keep their outputs."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ddplab.course.release import ReleaseError, release, release_notebook, strip_solutions

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


def test_the_course_notebook_releases_with_stubs_and_reference_check_outputs():
    course = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    student = release_notebook(course, "00_setup.ipynb")
    by_id = {c.id: c for c in student.cells}
    exercise, check = by_id["exercise-mean-score"], by_id["check-mean-score"]
    assert "NotImplementedError" in exercise.source and "all_reduce" not in exercise.source
    assert exercise.outputs == [] and exercise.execution_count is None
    assert exercise.metadata["tags"] == ["exercise"] and check.metadata["tags"] == ["check"]
    original = {c.id: c for c in course.cells}
    assert check.outputs == original["check-mean-score"].outputs != []
    assert check.source == original["check-mean-score"].source
    # every other cell is unchanged, outputs included; and the course notebook itself is untouched
    for cell in student.cells:
        if cell.id != "exercise-mean-score":
            assert cell == original[cell.id]
    assert "all_reduce" in original["exercise-mean-score"].source


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
