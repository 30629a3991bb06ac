"""A hand-in folder is untrusted input (ddplab/grade/handin.py): links are never followed, FIFOs,
sockets, devices and folders named like notebooks never opened, one graded copy per notebook per
student, and every student is a row of the report. Who a student is: ddplab/grade/students.py."""

import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from conftest import tiny_course

from ddplab.grade import class_run, report
from ddplab.grade.handin import MAX_SUBMISSION_BYTES, handed_in, read_text

ROOT = Path(__file__).resolve().parent.parent
NAME = "01_point_to_point.ipynb"
NAMES = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}


def _notebook(path: Path, age: float = 0.0) -> Path:
    """An empty notebook at ``path``, last modified ``age`` seconds ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(), path)
    when = time.time() - age
    os.utime(path, (when, when))
    return path


def _socket_at(path: Path) -> None:
    """A Unix socket's file at ``path`` (bound from its folder: a socket's path must be short)."""
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(path.name)
    finally:
        os.chdir(here)


def _rows(root: Path, **options) -> dict[tuple[str, str], tuple[str, str, tuple]]:
    """(section, student) -> (graded path under root, refused, copies under root)."""
    return {(h.section, h.student): (str(h.path.relative_to(root)), h.refused,
                                     tuple(c.replace(f"{root}/", "") for c in h.copies))
            for h in handed_in([root], NAMES, **options)}


@pytest.fixture
def class_folder(tmp_path):
    """A hand-in folder with one honest submission and each way to abuse one."""
    root = tmp_path / "submitted"
    _notebook(root / "alice" / NAME)
    _notebook(root / "bob" / "ps1" / NAME)                          # nbgrader's layout: still bob's
    _notebook(root / "eve" / NAME, age=60)
    _notebook(root / "eve" / "zoe" / NAME)                          # eve's newer copy, deeper
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
    assert found[("eve", f"eve/zoe/{NAME}")] == ""                  # the newest of eve's two copies
    assert "symbolic link" in found[("mallory", f"mallory/{NAME}")]
    assert "symbolic link" in found[("oscar", "oscar")]
    assert "not a regular file (a FIFO)" in found[("trudy", f"trudy/{NAME}")]
    assert "over the 32 MB" in found[("walter", f"walter/{NAME}")]
    assert not any(student == "zoe" for student, _ in found)
    assert len(found) == 7                                  # eve once; nothing under oscar's link
    [eve] = [h for h in handed_in([class_folder], NAMES) if h.student == "eve"]
    assert eve.copies == (f"{class_folder / 'eve' / NAME} (an older copy)",)


def test_a_student_is_the_folder_that_holds_the_notebooks_whatever_the_depth(tmp_path):
    # sections: two students of one section were one student "sec1" (issue 58)
    sections = tmp_path / "class"
    for who in ("sec1/alice", "sec1/bob", "sec2/alice", "sec2/carol"):
        _notebook(sections / who / NAME)
    assert _rows(sections) == {("sec1", "alice"): (f"sec1/alice/{NAME}", "", ()),
                               ("sec1", "bob"): (f"sec1/bob/{NAME}", "", ()),
                               ("sec2", "alice"): (f"sec2/alice/{NAME}", "", ()),   # two alices
                               ("sec2", "carol"): (f"sec2/carol/{NAME}", "", ())}
    # a flat folder of files named by student, and a folder of one student's notebooks
    _notebook(tmp_path / "flat" / "dave.ipynb")
    _notebook(tmp_path / "flat" / "erin.ipynb")
    assert set(_rows(tmp_path / "flat")) == {("", "dave"), ("", "erin")}
    _notebook(tmp_path / "frank" / NAME)
    assert set(_rows(tmp_path / "frank")) == {("", "frank")}
    # two folders named alike, named apart on the command line, stay two rows
    apart = handed_in([sections / "sec1", sections / "sec2"], NAMES)
    assert [(h.section, h.student) for h in apart] == [
        ("", "alice"), ("", "bob"), (str(sections / "sec2"), "alice"), ("", "carol")]


def test_a_second_copy_is_listed_with_the_newest_and_never_a_row_of_its_own(tmp_path):
    # nbgrader's layout: both of alice's folders are hers, whatever is named
    root = tmp_path / "submitted"
    _notebook(root / "alice" / "ps1" / NAME, age=60)
    _notebook(root / "alice" / "ps1_late" / NAME)
    _notebook(root / "bob" / "ps1" / NAME)
    assert _rows(root) == {
        ("", "alice"): (f"alice/ps1_late/{NAME}", "", (f"alice/ps1/{NAME} (an older copy)",)),
        ("", "bob"): (f"bob/ps1/{NAME}", "", ())}
    # the same without a submitted folder reads as sections; --student-depth 1 says otherwise
    os.rename(root, tmp_path / "class")
    assert set(_rows(tmp_path / "class")) == {("alice", "ps1"), ("alice", "ps1_late"), ("bob", "ps1")}
    assert _rows(tmp_path / "class", student_depth=1)[("", "alice")][2] == (
        f"alice/ps1/{NAME} (an older copy)",)
    # a copy that cannot be graded gives way to one that can, however new
    os.mkfifo(tmp_path / "class" / "bob" / "ps1" / "new.ipynb")
    os.rename(tmp_path / "class" / "bob" / "ps1" / "new.ipynb", tmp_path / "class" / "bob" / NAME)
    bob = _rows(tmp_path / "class", student_depth=1)[("", "bob")]
    assert bob[:2] == (f"bob/ps1/{NAME}", "") and "not a regular file (a FIFO)" in bob[2][0]


def test_no_folder_a_student_makes_names_another_student(tmp_path):
    root = tmp_path / "class"
    _notebook(root / "alice" / NAME)
    _notebook(root / "bob" / NAME, age=60)
    _notebook(root / "mallory" / "bob" / NAME)                       # mallory's, not a second bob
    _notebook(root / "mallory" / "submitted" / "bob" / "ps1" / NAME)  # nor nbgrader's bob
    rows = _rows(root)
    assert set(rows) == {("", "alice"), ("", "bob"), ("", "mallory")}
    assert rows[("", "bob")] == (f"bob/{NAME}", "", ())


def test_what_is_not_a_regular_file_is_refused_by_name_without_being_opened(tmp_path):
    root = tmp_path / "class"
    _notebook(root / "alice" / NAME)
    (root / "trudy").mkdir()
    os.mkfifo(root / "trudy" / NAME)
    (root / "sam").mkdir()
    _socket_at(root / "sam" / NAME)
    (root / "dan" / "06_build_all_reduce.ipynb").mkdir(parents=True)   # a folder named so
    _notebook(root / "dan" / "06_build_all_reduce.ipynb" / NAME)        # never entered
    rows = _rows(root)
    assert rows[("", "alice")] == (f"alice/{NAME}", "", ())
    assert "is not a regular file (a FIFO)" in rows[("", "trudy")][1]
    assert "is not a regular file (a socket)" in rows[("", "sam")][1]
    assert rows[("", "dan")][0] == "dan/06_build_all_reduce.ipynb"
    assert "is not a regular file (a folder)" in rows[("", "dan")][1]


def test_read_text_never_follows_a_link_or_waits_on_a_fifo(class_folder):
    assert read_text(class_folder / "alice" / NAME).startswith("{")
    with pytest.raises(ValueError, match="symbolic link is never followed"):
        read_text(class_folder / "mallory" / NAME)
    with pytest.raises(ValueError, match=r"not a regular file \(a FIFO\)"):
        read_text(class_folder / "trudy" / NAME)                    # returns at once: O_NONBLOCK


def test_the_journal_reads_a_hand_in_as_the_grader_does_never_waiting_on_a_fifo(class_folder):
    # A FIFO swapped in after the listing, or one the journal is asked about: its key reads it as
    # a hand-in is read. It used to open() it plainly, and wait for a writer that never comes.
    from ddplab.grade.journal import key

    fifo, keys = class_folder / "trudy" / NAME, []
    reader = threading.Thread(target=lambda: keys.append(key(fifo, ROOT / "notebooks" / NAME)),
                              daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        with open(fifo, "w"):               # let the stuck open() return, so the test can end
            pass
    assert keys and keys[0].startswith("unreadable-"), "key() waited on a FIFO for 10 s"


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
    alice = _notebook(root / "alice" / "ps1" / NAME, age=60)
    bob = _notebook(root / "bob" / "ps1" / NAME)
    again = _notebook(root / "alice" / "ps1-late" / NAME)
    found = handed_in([root / "alice" / "ps1", root / "bob" / "ps1", root / "alice" / "ps1-late"],
                      NAMES)
    assert [(h.student, h.path, h.refused) for h in found] == [
        ("alice", again, ""), ("bob", bob, "")]                  # was "ps1" x3; alice's once
    assert found[0].copies == (f"{alice} (an older copy)",)
    # a student's folder, or one file in it, named alone
    assert [h.student for h in handed_in([root / "bob"], NAMES)] == ["bob"]
    assert [h.student for h in handed_in([bob], NAMES)] == ["bob"]


@pytest.mark.slow               # it grades: a kernel per submission
def test_a_class_of_abuses_is_reported_row_by_row_and_nothing_opens_the_fifo(class_folder):
    rows = class_run.grade([class_folder], ROOT / "notebooks", jobs=2)
    assert [(row.student, Path(row.path).relative_to(class_folder).parts[1:]) for row in rows] == [
        ("alice", (NAME,)), ("bob", ("ps1", NAME)), ("eve", ("zoe", NAME)),
        ("mallory", (NAME,)), ("oscar", ()), ("trudy", (NAME,)), ("walter", (NAME,))]
    for row in rows:
        if row.student in ("alice", "bob", "eve"):     # graded: an empty notebook runs, earns nothing
            assert not row.error and row.marks and row.score == 0, row
        else:
            assert row.error.startswith("not graded: ") and not row.marks, row
    errors = {row.student: row.error for row in rows}
    assert "symbolic link" in errors["mallory"] and "not a regular file (a FIFO)" in errors["trudy"]
    assert "32 MB" in errors["walter"]
    assert [row.copies for row in rows if row.student == "eve"] == [
        [f"{class_folder / 'eve' / NAME} (an older copy)"]]


def _grade_class(folder: Path, reference: Path, out: Path, limit: float):
    """``ddplab grade`` on ``folder`` with CSV and Canvas files in ``out``: (wall seconds, result)."""
    out.mkdir()
    begin = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "ddplab", "grade", str(folder), "--reference",
                                 str(reference), "--csv", str(out / "g.csv"), "--canvas",
                                 str(out / "c.csv")], capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"grading {folder} was still running after {limit:.0f} s (stalled): {e.stderr}")
    return time.monotonic() - begin, result


@pytest.mark.slow               # it grades: a kernel per class
def test_a_fifo_a_socket_and_a_folder_named_like_a_notebook_never_delay_an_honest_student(tmp_path):
    # issue 64: a FIFO handed in as 06_build_all_reduce.ipynb stalled the class (no result in 66 s)
    reference, plain = tiny_course(tmp_path, "x = 1")               # mallory, honest: 1/1
    bad = tmp_path / "bad"
    shutil.copytree(plain, bad)
    for who in ("trudy", "sam", "dan"):
        (bad / who).mkdir()
    os.mkfifo(bad / "trudy" / "loud.ipynb")
    _socket_at(bad / "sam" / "loud.ipynb")
    (bad / "dan" / "06_build_all_reduce.ipynb").mkdir()
    took_plain, result = _grade_class(plain, reference, tmp_path / "plain-out", limit=600)
    assert result.returncode == 0, result.stdout + result.stderr
    took_bad, result = _grade_class(bad, reference, tmp_path / "bad-out", limit=4 * took_plain)
    print(f"[fifo class] {took_bad:.1f} s with the FIFO, socket and folder; {took_plain:.1f} s without")
    assert took_bad < 2 * took_plain, (took_bad, took_plain)
    assert result.returncode == 1, result.stdout + result.stderr   # three not graded
    rows = {row["student"]: row for row in csv.DictReader(open(tmp_path / "bad-out" / "g.csv"))}
    assert rows["mallory"]["score"] == "1" and rows["mallory"]["error"] == ""
    for who, name, kind in (("trudy", "loud", "a FIFO"), ("sam", "loud", "a socket"),
                            ("dan", "06_build_all_reduce", "a folder")):
        assert rows[who]["error"].startswith(f"not graded: {name}.ipynb is not a regular file "
                                             f"({kind})"), rows[who]
        assert re.search(rf"^{who} +error: not graded: {name}.ipynb is not a regular file \({kind}\)",
                         result.stdout, re.M), result.stdout
    canvas = {row["Student"]: row for row in csv.DictReader(open(tmp_path / "bad-out" / "c.csv"))}
    assert canvas["mallory"]["loud"] == "1" and canvas["trudy"]["loud"] == "0"
    gradescope = json.loads(report.to_gradescope(
        [class_run.Grade("trudy", "loud", "t", error=rows["trudy"]["error"])]))
    assert "not a regular file (a FIFO)" in gradescope["tests"][0]["output"]


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
