"""A hand-in folder is untrusted input (ddplab/grade/handin.py): links are never followed, FIFOs and
devices never opened, one submission per notebook per student, and every entry is a row of the report."""

import os
from pathlib import Path

import nbformat
import pytest
from conftest import tiny_course

from ddplab.grade import class_run
from ddplab.grade.handin import MAX_SUBMISSION_BYTES, handed_in, read_text

ROOT = Path(__file__).resolve().parent.parent
NAME = "01_point_to_point.ipynb"
NAMES = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}


def _notebook(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(), path)
    return path


@pytest.fixture
def class_folder(tmp_path):
    """A hand-in folder with one honest submission and each way to abuse one."""
    root = tmp_path / "submitted"
    _notebook(root / "alice" / NAME)
    _notebook(root / "bob" / "ps1" / NAME)                          # nbgrader's layout: still bob's
    _notebook(root / "eve" / NAME)
    _notebook(root / "eve" / "zoe" / NAME)                          # a second copy in eve's folder
    (root / "mallory").mkdir()
    (root / "mallory" / NAME).symlink_to(ROOT / "notebooks" / NAME)  # the reference, by a link
    (root / "oscar").symlink_to(ROOT / "notebooks")                # a whole folder, by a link
    (root / "trudy").mkdir()
    os.mkfifo(root / "trudy" / NAME)                                # opening it would wait forever
    (root / "walter").mkdir()
    with open(root / "walter" / NAME, "wb") as big:                 # sparse: costs no disk
        big.truncate(MAX_SUBMISSION_BYTES + 1)
    return root


def test_every_entry_is_found_with_its_student_and_the_abuses_are_refused_with_a_reason(class_folder):
    found = {(h.student, str(h.path.relative_to(class_folder))): h.refused
             for h in handed_in([class_folder], NAMES)}
    assert found[("alice", f"alice/{NAME}")] == ""
    assert found[("bob", f"bob/ps1/{NAME}")] == ""
    assert found[("eve", f"eve/{NAME}")] == ""
    assert f"second {NAME} in eve's folder" in found[("eve", f"eve/zoe/{NAME}")]
    assert f"eve/{NAME} is the one graded" in found[("eve", f"eve/zoe/{NAME}")]
    assert "symbolic link" in found[("mallory", f"mallory/{NAME}")]
    assert "symbolic link" in found[("oscar", "oscar")]
    assert "FIFO" in found[("trudy", f"trudy/{NAME}")]
    assert "over the 32 MB" in found[("walter", f"walter/{NAME}")]
    assert not any(student == "zoe" for student, _ in found)
    assert len(found) == 8                                          # nothing under oscar's link


def test_read_text_never_follows_a_link_or_waits_on_a_fifo(class_folder):
    assert read_text(class_folder / "alice" / NAME).startswith("{")
    with pytest.raises(ValueError, match="symbolic link is never followed"):
        read_text(class_folder / "mallory" / NAME)
    with pytest.raises(ValueError, match="is a FIFO"):
        read_text(class_folder / "trudy" / NAME)                    # returns at once: O_NONBLOCK


def test_files_named_on_the_command_line_keep_their_names(tmp_path):
    alone = _notebook(tmp_path / "carol.ipynb")
    in_folder = _notebook(tmp_path / "dave" / NAME)
    (tmp_path / "link.ipynb").symlink_to(alone)
    found = handed_in([alone, in_folder, tmp_path / "link.ipynb"], NAMES)
    assert [(h.student, bool(h.refused)) for h in found] == [("carol", False), ("dave", False),
                                                             ("link", True)]
    assert [h.student for h in handed_in([tmp_path / "dave", in_folder], NAMES)] == ["dave"]  # once
    with pytest.raises(FileNotFoundError, match="does not exist"):
        handed_in([tmp_path / "nobody"], NAMES)


def test_nbgrader_assignment_folders_named_one_by_one_are_still_named_by_student(tmp_path):
    # `ddplab grade submitted/*/ps1`: each folder named is "ps1"; the student is the one above it
    root = tmp_path / "submitted"
    alice, bob = _notebook(root / "alice" / "ps1" / NAME), _notebook(root / "bob" / "ps1" / NAME)
    again = _notebook(root / "alice" / "ps1-late" / NAME)
    found = handed_in([root / "alice" / "ps1", root / "bob" / "ps1", root / "alice" / "ps1-late"],
                      NAMES)
    assert [(h.student, h.path, bool(h.refused)) for h in found] == [
        ("alice", alice, False), ("bob", bob, False), ("alice", again, True)]   # was "ps1" x3
    assert f"is a second {NAME} of alice's" in found[2].refused and str(alice) in found[2].refused
    # a student's folder, or one file in it, named alone
    assert [h.student for h in handed_in([root / "bob"], NAMES)] == ["bob"]
    assert [h.student for h in handed_in([bob], NAMES)] == ["bob"]


@pytest.mark.slow               # it grades: a kernel per submission
def test_a_class_of_abuses_is_reported_row_by_row_and_nothing_opens_the_fifo(class_folder):
    rows = class_run.grade([class_folder], ROOT / "notebooks", jobs=2)
    assert [(row.student, Path(row.path).relative_to(class_folder).parts[1:]) for row in rows] == [
        ("alice", (NAME,)), ("bob", ("ps1", NAME)), ("eve", (NAME,)), ("eve", ("zoe", NAME)),
        ("mallory", (NAME,)), ("oscar", ()), ("trudy", (NAME,)), ("walter", (NAME,))]
    for row in rows:
        refused = row.student not in ("alice", "bob") and row.path != str(class_folder / "eve" / NAME)
        if refused:
            assert row.error.startswith("not graded: ") and not row.marks, row
        else:                       # graded: an empty notebook runs, and earns nothing
            assert not row.error and row.marks and row.score == 0, row
    errors = {Path(row.path).parent.name: row.error for row in rows}
    assert "symbolic link" in errors["mallory"] and "FIFO" in errors["trudy"]
    assert "32 MB" in errors["walter"] and "second" in errors["zoe"]


@pytest.mark.slow               # it grades: a kernel per submission
def test_a_cell_that_prints_megabytes_loses_its_exercise_with_the_reason(tmp_path):
    from ddplab.grade.run import MAX_CELL_OUTPUT_BYTES

    reference, submitted = tiny_course(tmp_path, f"print('x' * {MAX_CELL_OUTPUT_BYTES + 1})")
    [row] = class_run.grade([submitted], reference, jobs=1)
    assert row.student == "mallory" and not row.error
    [mark] = row.marks
    assert not mark.passed and "over the 16 MB a graded cell may print" in mark.reason, mark


def test_a_later_run_removes_the_work_folders_a_killed_grader_left(tmp_path, monkeypatch):
    import subprocess
    import sys

    import psutil

    monkeypatch.setattr(class_run.tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(gone.pid).create_time()
    gone.wait()
    for name, owner in (("killed", f"{gone.pid} {started}"), ("running", class_run._me()),
                        ("reused", f"{os.getpid()} 12345.0")):          # a pid now someone else's
        (tmp_path / f"ddplab-grade-{name}").mkdir()
        (tmp_path / f"ddplab-grade-{name}" / "grader").write_text(owner)
    (tmp_path / "ddplab-grade-fresh").mkdir()                          # its grader file not written yet
    removed = sorted(p.name for p in class_run.sweep_abandoned_work())
    assert removed == ["ddplab-grade-killed", "ddplab-grade-reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddplab-grade-fresh", "ddplab-grade-running"]
