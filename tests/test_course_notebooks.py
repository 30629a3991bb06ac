"""The notebooks that ship with ddplab: `ddplab notebooks`, the workspace, hint and solution."""

import importlib.util
import re
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
    written, kept, refused = copy_notebooks(tmp_path / "ws")
    assert sorted(p.name for p in written) == NOTEBOOKS and kept == [] and refused == []
    setup = nbformat.read(tmp_path / "ws" / "00_setup.ipynb", as_version=4)
    exercise = next(c for c in setup.cells if c.id == "exercise-mean-score")
    assert "NotImplementedError" in exercise.source and "all_reduce" not in exercise.source
    # the student works; a second run (the next `make lab`) keeps that work
    exercise.source = "%%ranks\nmean_score = 'my own attempt'"
    nbformat.write(setup, tmp_path / "ws" / "00_setup.ipynb")
    (tmp_path / "ws" / "02_collectives.ipynb").unlink()            # and one notebook is new
    written, kept, _ = copy_notebooks(tmp_path / "ws")
    assert [p.name for p in written] == ["02_collectives.ipynb"] and len(kept) == len(NOTEBOOKS) - 1
    assert "my own attempt" in (tmp_path / "ws" / "00_setup.ipynb").read_text()


def test_a_bad_entry_in_the_workspace_is_reported_and_the_other_notebooks_still_written(tmp_path):
    """Issue 58: a dangling link aborted the whole copy, the notebooks after it never written; and
    writing through it would have put a notebook wherever the link pointed."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "01_point_to_point.ipynb").symlink_to(tmp_path / "gone" / "01.ipynb")     # a dangling link
    (ws / "02_collectives.ipynb").mkdir()                                           # a folder
    written, kept, refused = copy_notebooks(ws)
    assert sorted(p.name for p in written) == [n for n in NOTEBOOKS if n not in
                                               ("01_point_to_point.ipynb", "02_collectives.ipynb")]
    assert kept == [] and len(refused) == 2
    assert "01_point_to_point.ipynb is a link to" in refused[0] and "which does not exist" in refused[0]
    assert f"rm {ws / '01_point_to_point.ipynb'}" in refused[0]
    assert "02_collectives.ipynb is a folder, not a notebook" in refused[1]
    assert not (tmp_path / "gone").exists() and (ws / "01_point_to_point.ipynb").is_symlink()
    result = subprocess.run([sys.executable, "-m", "ddplab", "notebooks", str(ws)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.count("ddplab notebooks: not copied: ") == 2
    assert result.stdout.count("kept ") == len(NOTEBOOKS) - 2


@pytest.mark.parametrize("dest, words", [
    ("/proc/nope", ["cannot make the folder /proc/nope: /proc does not let you make folders in it"]),
    ("afile", ["afile is a file; the notebooks go into a folder", "ddplab notebooks afile-course"]),
    ("afile/sub", ["cannot make the folder afile/sub: afile is a file"]),
    ("link", ["link is a link to", "which does not exist. Make that folder"]),
])
def test_a_destination_that_cannot_be_a_folder_is_one_line_with_the_fix(tmp_path, dest, words):
    """Issue 58: `ddplab notebooks /proc/nope` and `ddplab notebooks afile` gave bare errnos."""
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    result = subprocess.run([sys.executable, "-m", "ddplab", "notebooks", dest], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Errno" not in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert not (tmp_path / "nowhere").exists()


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


def test_an_old_spelling_finds_the_exercise_and_a_near_miss_gets_did_you_mean():
    assert ddplab.hints.hint_text("global_mean").startswith("Hint for global-mean (02_collectives")
    assert ddplab.hints.hint_text("Ping Pong").startswith("Hint for ping-pong (")
    assert ddplab.hints.hint_text("exercise-bf16_hook").startswith("Hint for bf16-hook (")
    with pytest.raises(CourseError) as info:
        ddplab.solution("ping_pong_typo")
    message = str(info.value)
    assert "no exercise named 'ping_pong_typo'. Did you mean 'ping-pong' (01_point_to_point)?" in message
    assert "mean-score" not in message and len(message) < 300          # not every name there is
    with pytest.raises(CourseError) as info:
        ddplab.hint("xyzzy")
    message = str(info.value)
    assert "nor one close to it" in message and 'Stuck? ddplab.hint("ping-pong")' in message
    assert len(message) < 300


def test_the_first_hint_reads_the_notebooks_without_nbformat():
    """Importing nbformat (its jsonschema validator compiles a grammar) made a kernel's first
    ddplab.hint take 11-12 s on a loaded machine; benchmarks/bench_hint.py times it."""
    code = ("import sys, ddplab; ddplab.hint('ping-pong'); "
            "print(sorted(m for m in ('nbformat', 'jsonschema', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    hint = exercises()["ping-pong"].metadata["ddplab"]["hint"]
    assert result.stdout.splitlines() == [f"Hint for ping-pong (01_point_to_point.ipynb): {hint}", "[]"]


NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_exercise_is_named_by_one_rule_and_its_text_ends_with_its_hint_line(name):
    """Names: lower-case words joined by hyphens, as cell ids are. Each exercise's text (the
    markdown cell above its exercise cell) ends with `Stuck? ddplab.hint("<name>")`, naming
    every exercise cell that follows it (03's three prompts share one text)."""
    cells = nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
    texts: dict[int, list[str]] = {}
    for index, cell in enumerate(cells):
        for prefix in ("exercise-", "check-"):
            if cell.get("id", "").startswith(prefix):
                assert NAME.fullmatch(cell.id[len(prefix):]), f"{name}: {cell.id}"
        if cell.get("id", "").startswith("exercise-"):
            above = max(i for i in range(index) if cells[i].cell_type == "markdown")
            texts.setdefault(above, []).append(cell.id[len("exercise-"):])
    for above, names in texts.items():
        last = cells[above].source.rstrip().splitlines()[-1]
        assert last == "Stuck? " + ", ".join(f'`ddplab.hint("{n}")`' for n in names), (name, last)
        for n in names:
            assert ddplab.hints.hint_text(n).startswith(f"Hint for {n} ({name})")


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
