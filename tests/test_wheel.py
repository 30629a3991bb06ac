"""What `pip install ddplab` gives a user, without the repository.

The wheel is built from this checkout and installed into a fresh virtual
environment in a temporary folder; every command then runs from a folder
outside the checkout, with PYTHONPATH cleared, and must find ddplab (and the
notebooks that ship with it) in that environment.

Dependencies: downloading torch and the rest again for each run would take
minutes and need the network, so the fresh environment borrows the project
environment's already-installed packages through a ``.pth`` line placed after
its own site-packages (the wheel's ddplab wins; the test checks it is the one
imported). That the wheel *declares* everything ddplab imports is checked
apart: ``test_every_import_of_the_package_is_declared`` in test_packaging.py,
and here, that every requirement in the wheel's metadata is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding only the ddplab wheel, a folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((tmp / "dist").glob("ddplab-*.whl"))
    venv.EnvBuilder(with_pip=True).create(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; "
                                         "print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=_user_env())
    assert done.returncode == 0, done.stdout + done.stderr
    # after the install: pip would otherwise see the project's own (editable) ddplab and skip it
    (site / "zz_borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "user"
    work.mkdir()
    return python, work


def _user_env() -> dict:
    """The environment without PYTHONPATH (which may point at a checkout)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(installed, *args, timeout=300):
    python, work = installed
    env = _user_env()
    ddplab = python.parent / "ddplab"
    return subprocess.run([str(ddplab), *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_package_is_the_wheel_and_its_requirements_are_installed(installed):
    python, work = installed
    env = _user_env()
    code = ("import importlib.metadata as m, re, ddplab; print(ddplab.__file__)\n"
            "for r in m.requires('ddplab'):\n"
            "    if 'extra ==' in r: continue\n"
            "    name = re.split(r'[=<>!~\\[ ;]', r)[0]\n"
            "    print(name, m.version(name))\n")
    out = subprocess.run([str(python), "-c", code], cwd=work, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith(str(python.parent.parent)) and "site-packages" in first, first
    assert not first.startswith(str(ROOT))
    assert "nbval" in out.stdout and "psutil" in out.stdout


def test_doctor_runs_from_the_installed_package(installed):
    result = _run(installed, "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-test   ok: 2 ranks, backend gloo, all_reduce correct" in result.stdout


def test_notebooks_release_and_grade_run_from_the_installed_package(installed):
    _, work = installed
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    student = _run(installed, "notebooks", "course")
    assert student.returncode == 0, student.stderr
    assert sorted(p.name for p in (work / "course").glob("*.ipynb")) == shipped
    setup = (work / "course" / "00_setup.ipynb").read_text()
    assert "NotImplementedError" in setup and "BEGIN SOLUTION" not in setup

    reference = _run(installed, "notebooks", "reference", "--reference")
    assert reference.returncode == 0, reference.stderr
    assert "BEGIN SOLUTION" in (work / "reference" / "00_setup.ipynb").read_text()

    released = _run(installed, "release", "reference", "-o", "released")
    assert released.returncode == 0, released.stderr
    assert sorted(p.name for p in (work / "released").glob("*.ipynb")) == shipped

    # alice hands in the reference (every answer right), bob the untouched student version
    for who, folder in (("alice", "reference"), ("bob", "course")):
        (work / "submitted" / who).mkdir(parents=True)
        (work / "submitted" / who / "00_setup.ipynb").write_text(
            (work / folder / "00_setup.ipynb").read_text())
    graded = _run(installed, "grade", "submitted", "--csv", "grades.csv", timeout=600)
    assert graded.returncode == 1, graded.stdout + graded.stderr     # bob did not pass
    rows = {line.split(",")[0]: line for line in (work / "grades.csv").read_text().splitlines()}
    assert rows["alice"].startswith("alice,00_setup,1,1,1,"), rows
    assert rows["bob"].startswith("bob,00_setup,0,0,1,"), rows
