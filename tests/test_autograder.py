"""Gradescope's autograder (`ddplab autograder`), rehearsed on a fake `/autograder` tree.

The zip is built from the hostile class's small reference (tests/hostile/attacks.py) and
unpacked as Gradescope unpacks it; its `ddplab-src` is installed into a Python every user may
run (the students' environment of tests/shared_env.py supplies a student's packages, pip the
`grade` extra's nbval), as its `setup.sh` installs it. Then, for each submission, its
`run_autograder` runs as Gradescope runs it: as root, with no bubblewrap (`DDPLAB_SANDBOX=0`),
the submission in `submission/`, the results read from `results/results.json`. Submissions run
as `nobody`, a user without rights.

The scores must be what `ddplab grade --csv` gives the same submissions, the deserved scores of
`tests/hostile/attacks.py` (tests/test_grade_hostile.py asserts them of `ddplab grade --csv`),
including the published attack on Gradescope's autograders: a submission that writes
`results.json` itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
import shared_env
from hostile import attacks

from ddplab import procs
from ddplab.course.autograder import build

pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(900)]

NOTEBOOK = "00_setup.ipynb"
ROOT = Path(__file__).resolve().parent.parent
ATTACKS = {name: attacks.ATTACKS[name] for name in
           ("honest", "steal_solution", "rewrite_results")}
CELL_TIMEOUT = 60



@pytest.fixture(scope="module")
def gradescope():
    """Every submission through its own fake /autograder tree; results and what was left."""
    env_prefix = shared_env.ensure().prefix
    # Not in the suite's temporary folder: user nobody must reach the tree and its Python.
    home = Path(tempfile.mkdtemp(prefix="ddplab-autograder-", dir="/tmp"))
    try:
        home.chmod(0o755)
        nbformat.write(attacks.reference(), home / NOTEBOOK)
        archive = build([home / NOTEBOOK], home / "autograder.zip", cell_timeout=CELL_TIMEOUT)
        python = _install_like_setup_sh(archive, home, env_prefix)
        marker = f"ddplab-autograder-{uuid.uuid4().hex}"
        roots = {}
        for i, name in enumerate(ATTACKS):
            root = roots[name] = home / str(i)      # short: a lab's sockets live under it
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(root / "source")
            (root / "source" / "run_autograder").chmod(0o755)
            root.chmod(0o700)                    # no submission reads another's
            (root / "submission").mkdir()
            (home / f"tmp{i}").mkdir()
            (home / f"tmp{i}").chmod(0o1777)
            results = root / "results" / "results.json"
            (root / "submission" / NOTEBOOK).write_text(attacks.submission(
                name, marker=marker, reference=str(root / "source" / "reference" / NOTEBOOK),
                other=str(home / "0" / "submission"), csv=str(results)))
        untouched = (home / "0" / "submission" / NOTEBOOK).read_bytes()

        def run(name: str) -> subprocess.CompletedProcess:
            root = roots[name]
            i = list(ATTACKS).index(name)
            env = dict(os.environ, AUTOGRADER_ROOT=str(root), DDPLAB_PYTHON=str(python),
                       DDPLAB_STUDENT_USER="nobody", DDPLAB_SANDBOX="0", TMPDIR=str(home / f"tmp{i}"))
            return _in_a_container(root / "source" / "run_autograder", env, timeout=600)

        with ThreadPoolExecutor(max_workers=2) as pool:   # Gradescope runs each in a container
            ran = dict(zip(ATTACKS, pool.map(run, ATTACKS)))
        right_after = attacks.survivors(marker)
        results = {name: roots[name] / "results" / "results.json" for name in ATTACKS}
        yield {"ran": ran, "results": results, "right_after": right_after, "marker": marker,
               "home": home, "python": python, "archive": archive,
               "honest_copy_untouched": untouched == (home / "0" / "submission" / NOTEBOOK)
               .read_bytes()}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _in_a_container(script: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``bash script`` where, as in Gradescope's container, there is no course checkout to read:
    this one (and /work, where checkouts live on this project's machines) hidden under empty
    folders, in a mount namespace of its own."""
    hide = [str(ROOT)] + [p for p in ("/work",) if os.path.isdir(p) and p != str(ROOT)]
    mounts = "".join(f"mount -t tmpfs -o size=1m,mode=0755 ddplab-hidden {p} && " for p in hide)
    return procs.run_command(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                              f"{mounts}cd / && exec bash {script}"], env=env, timeout=timeout,
                             capture_output=True, text=True)


def _install_like_setup_sh(archive: Path, home: Path, env_prefix: Path) -> Path:
    """A venv with the zip's ddplab installed (its dependencies seen from the students'
    environment): what setup.sh makes at /opt/ddplab. Its Python."""
    unpacked = home / "unpacked"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(unpacked)
    venv = home / "venv"
    base = os.path.realpath(env_prefix / "bin" / "python")
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    deps = next(env_prefix.glob("lib/python3*/site-packages"))
    # After this venv's own site-packages: the zip's ddplab comes first, the shipped one never.
    (site / "deps.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    # With its dependencies, pinned by the zip's constraints, as setup.sh installs it: pip finds the
    # students' environment's and adds what grading needs beyond a student's install (nbval).
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                    "--quiet", "--no-build-isolation", "--no-compile",
                    "-c", str(unpacked / "constraints.txt"), str(unpacked / "ddplab-src")],
                   check=True, timeout=300, capture_output=True)
    return venv / "bin" / "python"


def test_the_zip_holds_what_gradescope_runs_and_no_shipped_solutions(gradescope):
    with zipfile.ZipFile(gradescope["archive"]) as zf:
        names = set(zf.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in zf.infolist()}
        setup = zf.read("setup.sh").decode()
    assert {"setup.sh", "run_autograder", "constraints.txt", f"reference/{NOTEBOOK}",
            "ddplab-src/pyproject.toml", "ddplab-src/ddplab/grade/nbval_sanitize.cfg"} <= names
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert not [n for n in names if n.startswith("ddplab-src/ddplab/course/notebooks/")]
    import torch
    assert f'"torch=={torch.__version__}"' in setup and "download.pytorch.org/whl/cpu" in setup
    assert subprocess.run(["bash", "-n", "-c", setup]).returncode == 0
    located = subprocess.run([str(gradescope["python"]), "-c", "import ddplab; print(ddplab.__file__)"],
                             capture_output=True, text=True, timeout=120, cwd="/").stdout
    assert str(gradescope["home"] / "venv") in located, located


@pytest.mark.parametrize("name", list(ATTACKS))
def test_each_submission_scores_what_ddplab_grade_gives_it(gradescope, name):
    ran = gradescope["ran"][name]
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    results = json.loads(gradescope["results"][name].read_text())
    _, deserved = ATTACKS[name]
    assert results["score"] == deserved, (results, ran.stdout[-2000:])
    assert [t["name"] for t in results["tests"]] == ["00_setup: mean-score"], results
    assert "each submission runs as nobody (--run-as)" in ran.stdout    # and says so


def test_the_results_file_is_the_graders_alone(gradescope):
    results = gradescope["results"]["rewrite_results"]
    assert results.stat().st_uid == 0 and "forged" not in results.read_text()
    assert gradescope["honest_copy_untouched"]


def test_nothing_a_submission_started_is_left_running(gradescope):
    assert gradescope["right_after"] == []
    assert attacks.survivors(gradescope["marker"]) == []


def test_an_upload_without_the_notebook_gets_a_reason_not_a_failed_autograder(gradescope):
    root = gradescope["home"] / "no-notebook"
    with zipfile.ZipFile(gradescope["archive"]) as zf:
        zf.extractall(root / "source")
    (root / "submission").mkdir(parents=True)
    (root / "submission" / "homework.py").write_text("print('my answer')\n")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), DDPLAB_PYTHON=str(gradescope["python"]),
               DDPLAB_STUDENT_USER="nobody", DDPLAB_SANDBOX="0")
    ran = _in_a_container(root / "source" / "run_autograder", env, timeout=300)
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0, (results, ran.stdout)
    assert results["output"].startswith("Not graded: ddplab grade: no submitted notebooks found"), results


def test_run_as_refuses_what_would_not_work_and_says_the_fix(tmp_path, capsys):
    from ddplab.course.cli import main
    nbformat.write(attacks.reference(), tmp_path / NOTEBOOK)
    cases = (("no-such-user-ddplab", "useradd --system"), ("root", "is root"))
    for user, words in cases:
        assert main(["grade", str(tmp_path / NOTEBOOK), "--reference", str(tmp_path),
                     "--run-as", user]) == 2
        err = capsys.readouterr().err
        assert (words if os.geteuid() == 0 else "needs root") in err, err


def test_autograder_refuses_a_reference_without_check_outputs_and_a_bad_output(tmp_path, capsys):
    from ddplab.course.cli import main
    bare = attacks.reference()
    for cell in bare.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    nbformat.write(bare, tmp_path / NOTEBOOK)
    assert main(["autograder", str(tmp_path / NOTEBOOK), "-o", str(tmp_path / "a.zip")]) == 2
    assert "check" in capsys.readouterr().err
    nbformat.write(attacks.reference(), tmp_path / NOTEBOOK)
    assert main(["autograder", str(tmp_path / NOTEBOOK), "-o", str(tmp_path / "a.tar")]) == 2
    assert "must name a .zip" in capsys.readouterr().err
    assert main(["autograder", str(tmp_path / NOTEBOOK), "-o", str(tmp_path / "no" / "a.zip")]) == 2
    assert "does not exist" in capsys.readouterr().err
