"""The grader's own processes and folders: each sandbox is reaped as it ends, and a grader told to stop
(SIGTERM) ends its workers and removes their work folders itself, leaving only finished results."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import tiny_course

from ddplab import procs
from ddplab.grade import class_run, sandbox

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]       # they grade: a kernel per submission


def _bwrap_zombies(since: float) -> list[psutil.Process]:
    """The ``[bwrap] <defunct>`` processes made since ``since`` (this process's, or init's)."""
    found = []
    for proc in psutil.process_iter(["name", "status", "ppid", "create_time"]):
        info = proc.info
        if (info["name"] == "bwrap" and info["status"] == psutil.STATUS_ZOMBIE
                and info["ppid"] in (os.getpid(), 1) and (info["create_time"] or 0) >= since):
            found.append(proc)
    return found


def _command(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""                            # gone, or a zombie


def test_each_sandbox_is_reaped_as_its_submission_ends(tmp_path):
    # The outer bwrap exits without reaping its own child (the sandbox's pid 1), which then went to
    # init; an init that is not a real one (a container's pid 1 program) kept one zombie per
    # submission. The grader is now their subreaper while it grades, and reaps each as it ends.
    if sandbox.unavailable_reason():
        pytest.skip(f"no sandbox here ({sandbox.unavailable_reason()}): no bwrap to leave a zombie")
    reference, submitted = tiny_course(tmp_path, "x = 1")
    for who in ("trent", "peggy"):
        (submitted / who).mkdir()
        (submitted / who / "loud.ipynb").write_text((submitted / "mallory" / "loud.ipynb").read_text())
    begin, seen = time.time(), []
    # The suite's own labs may be this process's children already; the grader must add none.
    ours = {p.pid for p in psutil.Process().children()}

    def finished(grade) -> None:             # as each submission ends, before the next starts
        seen.append((grade.student, [p.pid for p in _bwrap_zombies(begin)]))

    # One at a time: with two, one's progress could look while the other's orphan is being reaped.
    grades = class_run.grade([submitted], reference, jobs=1, progress=finished)
    assert [(g.student, g.score) for g in grades] == [("mallory", 1), ("peggy", 1), ("trent", 1)]
    assert [zombies for _, zombies in seen] == [[], [], []], seen
    assert _bwrap_zombies(begin) == []
    assert {p.pid for p in psutil.Process().children()} <= ours, "the grader left a child"


def test_a_grader_stopped_by_sigterm_leaves_no_work_folder_no_process_and_no_false_result(tmp_path):
    # The last round's re-check: `ddplab grade` ended by SIGTERM left its work folder for the next
    # run to sweep (and, unsandboxed, a worker running on). Now SIGTERM stops it as Ctrl-C does.
    reference, submitted = tiny_course(tmp_path, "import time\ntime.sleep(600)")
    scratch = Path(tempfile.gettempdir())       # the suite's own (tests/leakcheck.py)
    before = set(scratch.glob("ddplab-grade-*"))
    grader = subprocess.Popen(
        [sys.executable, "-m", "ddplab", "grade", str(submitted), "--reference", str(reference),
         "--csv", str(tmp_path / "g.csv"), "--cell-timeout", "900"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:     # until the submission's kernel runs its cell
            family = psutil.Process(grader.pid).children(recursive=True)
            if any("ipykernel" in _command(p) for p in family) and \
                    set(scratch.glob("ddplab-grade-*")) - before:
                break
            assert grader.poll() is None, grader.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the submission's kernel never started")
        family = psutil.Process(grader.pid).children(recursive=True)
        assert procs.send(grader, signal.SIGTERM)
        out, err = grader.communicate(timeout=60)
    finally:
        procs.end_tree(grader, grace=5)            # nothing, once it has ended by itself
        grader.wait()
    assert grader.returncode == 128 + signal.SIGTERM, err
    assert set(scratch.glob("ddplab-grade-*")) - before == set(), "the work folder was left behind"
    _, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [], f"left running: {[_command(p) for p in alive]}"
    journal = tmp_path / "g.csv.journal"          # kept for --resume, with nothing unfinished in it
    assert not journal.exists() or [json.loads(line)["grade"]["student"]
                                    for line in journal.read_text().splitlines()] == []
    assert not Path(tmp_path / "g.csv").exists()
