"""`ddplab doctor` as a user runs it: a real subprocess that starts and stops a real lab."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_doctor_reports_and_self_tests():
    result = subprocess.run([sys.executable, "-m", "ddplab.course.cli", "doctor"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "torch       2.13.0" in out
    assert "gloo" in out.split("backends")[1].splitlines()[0]
    assert "GPUs" in out
    assert "self-test   ok: 2 ranks, backend gloo, all_reduce correct" in out


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ddplab.course.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.slow
def test_grade_of_a_missing_path_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "nobody" / "01_x.ipynb"
    result = _cli("grade", str(missing), "--reference", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "does not exist" in lines[0], lines


@pytest.mark.slow
def test_release_of_a_corrupt_notebook_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "01_x.ipynb"
    bad.write_text("{not json")
    result = _cli("release", str(bad), "-o", str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "not a readable notebook" in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output, words", [
    ("{tmp}/taken.txt", "is a file; -o names the folder"),
    ("/proc/released", "cannot be made"),
])
def test_release_to_an_unusable_output_is_one_line_and_exit_2(tmp_path, output, words):
    (tmp_path / "taken.txt").write_text("mine")
    result = _cli("release", str(ROOT / "notebooks" / "00_setup.ipynb"), "-o", output.format(tmp=tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert (tmp_path / "taken.txt").read_text() == "mine"


def test_grading_runs_twice_the_cores_at_once_as_far_as_memory_allows():
    from ddplab.grade.class_run import SUBMISSION_MEMORY_BYTES, default_jobs
    assert default_jobs(available=64 * 2**30, cores=2) == 8
    assert default_jobs(available=3 * SUBMISSION_MEMORY_BYTES, cores=2) == 3
    assert default_jobs(available=SUBMISSION_MEMORY_BYTES // 2, cores=8) == 1


OPTION_CASES = [
    (["--cell-timeout", "-1"], "--cell-timeout -1.0 is not a positive number"),
    (["--cell-timeout", "0"], "--cell-timeout 0.0 is not a positive number"),
    (["--cell-timeout", "nan"], "--cell-timeout nan is not a positive number"),
    (["--jobs", "0"], "--jobs 0 is not a positive number"),
    (["--csv", "{tmp}/missing/grades.csv"], "does not exist"),
    (["--csv", "{tmp}"], "is a folder"),
    (["--csv", "{tmp}/00_setup.ipynb/grades.csv"], "is a file, not a folder"),
    (["--csv", "{tmp}/grades.csv", "--junit", "{tmp}/grades.csv"], "--csv and --junit both name"),
    (["--junit", "{tmp}/00_setup.ipynb"], "would overwrite a notebook"),
    (["--csv", "/proc/grades.csv"], "cannot be written"),
    (["--resume"], "--resume needs --csv or --junit"),
    (["--resume", "--csv", "{tmp}/grades.csv"], "found no journal"),
]

# The command's main() on each case's argv, in one subprocess (an interpreter start and
# ddplab's imports cost about two CPU seconds; ten of them were a tenth of `make test-fast`):
# its exit code and what it printed to stderr, each case in a folder of its own.
_EACH_ARGV = """
import contextlib, io, json, sys
from ddplab.course.cli import main
found = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    found.append([code, err.getvalue()])
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def option_runs(tmp_path_factory):
    """Case index -> (its folder, exit code, stderr) of `ddplab grade` with that case's options."""
    import json

    folders, argvs = [], []
    for options, _ in OPTION_CASES:
        tmp = tmp_path_factory.mktemp("options")
        (tmp / "00_setup.ipynb").write_text("{}")
        folders.append(tmp)
        argvs.append(["grade", str(tmp / "00_setup.ipynb"), "--reference", str(tmp),
                      *[o.format(tmp=tmp) for o in options]])
    result = subprocess.run([sys.executable, "-c", _EACH_ARGV, json.dumps(argvs)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return [(folder, code, err) for folder, (code, err) in zip(folders, json.loads(result.stdout))]


@pytest.mark.parametrize("case", range(len(OPTION_CASES)),
                         ids=[" ".join(options) for options, _ in OPTION_CASES])
def test_grade_checks_its_options_and_outputs_before_grading(option_runs, case):
    tmp_path, returncode, stderr = option_runs[case]
    words = OPTION_CASES[case][1]
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert not list(tmp_path.glob("*.csv*"))          # nothing was graded, nothing written
