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


def _solution_blocks() -> list[str]:
    """Every solution of the course, as the lines between its markers (blank lines left out)."""
    import nbformat
    blocks = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            inside, lines = False, []
            for line in cell.source.splitlines():
                if line.strip() in ("### BEGIN SOLUTION", "### END SOLUTION"):
                    inside = not inside
                    if not inside and lines:
                        blocks.append("\n".join(lines))
                        lines = []
                elif inside and line.strip():
                    lines.append(line.strip())
    return blocks


def _texts_of(folder: Path):
    """(path, its text with every line stripped) for each file under ``folder``; a notebook's
    text is its cells' sources (its JSON splits a block over quoted lines)."""
    import json
    for path in folder.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.suffix in (".pyc", ".so"):
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        if path.suffix == ".ipynb":
            raw = "\n".join("".join(c["source"]) for c in json.loads(raw)["cells"])
        yield path, "\n".join(line.strip() for line in raw.splitlines() if line.strip())


# Last in this module: it makes the installation solution-free for good.
def test_remove_solutions_leaves_no_solution_text_in_the_environment_and_keeps_the_hints(installed):
    python, work = installed
    blocks = _solution_blocks()
    assert len(blocks) >= 40, len(blocks)
    before = [b for b in blocks if any(b in text for _, text in _texts_of(python.parent.parent))]
    assert len(before) == len(blocks), "the wheel ships the reference notebooks"

    done = _run(installed, "remove-solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "carries no solutions now" in done.stdout
    found = {str(path.relative_to(python.parent.parent)): block[:60]
             for path, text in _texts_of(python.parent.parent) for block in blocks if block in text}
    # A checker computes what it expects, sometimes with the very calls its exercise teaches
    # (10's save through DCP's get_state_dict, 11's checkpointed blocks): those stay, and
    # docs/instructors.md says so. No solution is anywhere else: no notebook, no other module.
    outside_checkers = {path: block for path, block in found.items()
                        if "/site-packages/ddplab/check/" not in f"/{path}"}
    assert outside_checkers == {}, outside_checkers

    again = _run(installed, "remove-solutions")         # once is enough; twice changes nothing
    assert again.returncode == 0 and "student version" not in again.stdout
    code = ("import ddplab\nddplab.hint('ping-pong')\ntry:\n    ddplab.solution('ping-pong')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    asked = subprocess.run([str(python), "-c", code], cwd=work, env=_user_env(), capture_output=True,
                           text=True, timeout=120)
    assert asked.stdout.startswith("Hint for ping-pong (01_point_to_point.ipynb): "), asked
    assert "CourseError ddplab: ddplab.solution('ping-pong'): this installation has no solutions" \
        in asked.stdout, asked.stdout
    for args in (["notebooks", "ref", "--reference"], ["grade", "submitted"]):
        refused = _run(installed, *args)
        assert refused.returncode == 2 and "removed for a graded term" in refused.stderr, refused
