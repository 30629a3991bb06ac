"""The notebooks that ship with ddplab: `ddplab notebooks`, the workspace, hint and solution."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import ddplab
from ddplab.course.notebooks import CourseError, copy_notebooks
from ddplab.hints import exercises, reference_dir

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def _clean_module():
    spec = importlib.util.spec_from_file_location("clean_notebook", ROOT / "tools" / "clean_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_checkout_reads_its_own_notebooks_folder():
    assert reference_dir() == ROOT / "notebooks"


def test_student_versions_are_copied_and_never_overwritten(tmp_path):
    written, kept = copy_notebooks(tmp_path / "ws")
    assert sorted(p.name for p in written) == NOTEBOOKS and kept == []
    setup = nbformat.read(tmp_path / "ws" / "00_setup.ipynb", as_version=4)
    exercise = next(c for c in setup.cells if c.id == "exercise-mean-score")
    assert "NotImplementedError" in exercise.source and "all_reduce" not in exercise.source
    # the student works; a second run (the next `make lab`) keeps that work
    exercise.source = "%%ranks\nmean_score = 'my own attempt'"
    nbformat.write(setup, tmp_path / "ws" / "00_setup.ipynb")
    (tmp_path / "ws" / "02_collectives.ipynb").unlink()            # and one notebook is new
    written, kept = copy_notebooks(tmp_path / "ws")
    assert [p.name for p in written] == ["02_collectives.ipynb"] and len(kept) == len(NOTEBOOKS) - 1
    assert "my own attempt" in (tmp_path / "ws" / "00_setup.ipynb").read_text()


@pytest.mark.slow
def test_the_command_copies_reference_versions_with_the_flag(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ddplab", "notebooks", str(tmp_path / "ref"),
                             "--reference"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"copied {tmp_path / 'ref' / '00_setup.ipynb'} (reference version)" in result.stdout
    for name in NOTEBOOKS:
        assert (tmp_path / "ref" / name).read_bytes() == (ROOT / "notebooks" / name).read_bytes()
    again = subprocess.run([sys.executable, "-m", "ddplab", "notebooks", str(tmp_path / "ref")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "never overwritten" in again.stdout


def test_every_exercise_has_a_name_and_a_solution():
    found = exercises()
    assert "ping-pong" in found and "mean-score" in found
    for name in found:
        text = ddplab.hints.solution_text(name)
        assert text.startswith(f"# Reference solution of {name} (")
        assert "BEGIN SOLUTION" not in text and "NotImplementedError" not in text


def test_hint_then_solution_from_a_cell(capsys):
    ddplab.hint("ping-pong")
    hint = capsys.readouterr().out
    assert hint.startswith("Hint for ping-pong (01_point_to_point.ipynb)") or "No hint" in hint
    ddplab.solution("exercise-ping-pong")
    solution = capsys.readouterr().out
    assert "dist.send" in solution and "dist.recv" in solution and "def ping_pong" in solution


def test_an_unknown_exercise_names_the_known_ones():
    with pytest.raises(CourseError) as info:
        ddplab.solution("ping_pong_typo")
    message = str(info.value)
    assert "no exercise named 'ping_pong_typo'" in message
    assert "ping-pong (01)" in message and "mean-score (00)" in message


def test_the_cleaner_writes_nbgrader_metadata_from_ids_and_tags(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# x", id="intro"),
        nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", id="exercise-x",
                                  metadata={"tags": ["exercise"], "ddplab": {"hint": "one"},
                                            "collapsed": True}),
        nbformat.v4.new_code_cell("ddplab.check.x()", id="check-x", metadata={"tags": ["check"]}),
        nbformat.v4.new_code_cell("y = 2", id="stray",
                                  metadata={"nbgrader": {"solution": True, "grade_id": "old"}}),
    ]
    nbformat.write(nb, tmp_path / "n.ipynb")
    _clean_module().clean(str(tmp_path / "n.ipynb"))
    cells = nbformat.read(tmp_path / "n.ipynb", as_version=4).cells
    assert cells[1].metadata == {
        "tags": ["exercise"], "ddplab": {"hint": "one"},
        "nbgrader": {"grade_id": "exercise-x", "schema_version": 3, "task": False, "solution": True,
                     "grade": False, "locked": False}}
    assert cells[2].metadata["nbgrader"] == {"grade_id": "check-x", "schema_version": 3,
                                             "task": False, "solution": False, "grade": True,
                                             "locked": True, "points": 1}
    assert "nbgrader" not in cells[0].metadata and "nbgrader" not in cells[3].metadata


def test_solution_markers_appear_only_in_exercise_cells():
    """nbgrader refuses a notebook with a solution region outside a solution cell."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if "SOLUTION" in cell.source and ("BEGIN" in cell.source or "END" in cell.source):
                assert cell.metadata.get("nbgrader", {}).get("solution"), (path.name, cell.id)


def test_every_exercise_and_check_carries_its_nbgrader_metadata():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.get("id", "").startswith(("exercise-", "check-")):
                assert cell.metadata["nbgrader"]["grade_id"] == cell.id, (path.name, cell.id)


# Every exercise gets a hint (docs/contributing.md, "Adding an exercise"): a nudge, not the answer.
HINTED = sorted(exercises())


@pytest.mark.parametrize("name", HINTED)
def test_the_exercise_has_a_hint_that_does_not_give_the_solution_away(name):
    from ddplab.hints import hint_text, solution_text

    hint = hint_text(name)
    assert hint.startswith(f"Hint for {name} (") and len(hint) > 40
    code = [line.strip() for line in solution_text(name).splitlines()[1:] if len(line.strip()) > 25]
    assert code and not all(line in hint for line in code), f"the hint is the solution: {hint}"


def test_make_lab_opens_the_student_workspace_and_lab_reference_the_notebooks(tmp_path):
    import os
    import subprocess

    def commands(target: str) -> str:           # what make would run (-n), with a fresh .venv
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        return subprocess.run(["make", "-n", "--no-print-directory", f"VENV={tmp_path}", target],
                              cwd=ROOT, env=env, capture_output=True, text=True, check=True,
                              timeout=60).stdout

    lab = commands("lab")
    assert "ddplab notebooks workspace" in lab and "--notebook-dir=workspace" in lab
    assert "--notebook-dir=notebooks" in commands("lab-reference")
    assert "workspace/" in (ROOT / ".gitignore").read_text().splitlines()
