"""The course from a wheel, as Colab, Kaggle or a JupyterHub would run it (issue 57).

The wheel is built from this checkout once for the module and installed into a fresh
virtual environment (no system site-packages, nothing borrowed from the project's .venv)
with only ``pip install ddplab-<version>.whl``: no clone, no make. pip fetches the
dependencies from this machine's package index as usual and reuses its cache (which
``make test``'s own install fills; on the development machine the index is a local
mirror). ``PIP_CONSTRAINT=constraints.txt`` picks the versions the course is tested with:
without it pip takes the newest torch, which on PyPI is the CUDA build and its GBs of
nvidia wheels (Colab and Kaggle have a torch already, which pip keeps). Every command runs
from a folder outside the checkout, with PYTHONPATH cleared. The tests run in this order:

1. the environment holds the wheel's ddplab and a student's profile: none of the
   instructor's or the tests' tools;
2. ``ddplab doctor``;
3. ``ddplab notebooks course`` writes the student notebooks, and the opening sections of
   two of them run in that environment's kernel with a lab of 2 ranks, their outputs as the
   reference's (compared as nbval compares): 00 (its first section, "Two bare prompts":
   the notebook every student runs first, torch.distributed by hand on two ``%%rank``
   prompts) and 05 (through "Data": the placement report, then scikit-learn's digits on the
   ranks and a matplotlib figure in the kernel, the heaviest of a student's dependencies).
   Not all 17: each notebook's set-up cell is the same guard (tests/test_packaging.py
   checks it) and nbval runs every notebook whole in the project's environment;
4. a notebook's set-up cell with ddplab missing (uninstalled, the rest of the environment
   kept, as in Colab): without a wheel at hand it shows pip's own error and stops; with the
   wheel beside the notebook (uploaded, as a student would) ``%pip`` installs it and the cell
   says so in one line;
5. ``ddplab grade`` refuses, naming the ``grade`` extra; with ``<wheel>[grade]`` installed,
   ``release`` and ``grade`` run;
6. ``remove-solutions``, last: it makes the installation solution-free for good.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import nbformat
import pytest
from nbval.plugin import find_comment_markers

from ddplab.grade.compare import difference, sanitize_patterns

ROOT = Path(__file__).resolve().parent.parent
RUN_CELLS = Path(__file__).resolve().parent / "run_cells.py"
# notebook -> the first cell not run: its opening sections end there (see the docstring)
OPENING = {"00_setup.ipynb": "cell-19", "05_ddp_training.ipynb": "cell-10"}
SAYS_INSTALLED = "ddplab was not installed here: installed ddplab {version} with %pip."
# What a student never needs: the instructor's and the tests' tools (their distributions).
NOT_A_STUDENTS = ("nbgrader", "jupyterhub", "playwright", "pytest", "nbval", "ruff", "mkdocs",
                  "mkdocs-material", "mkdocs-jupyter", "mkdocstrings-python", "jupytext")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _user_env() -> dict:
    """The environment without PYTHONPATH (which may point at a checkout), with the tested pins."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_CONSTRAINT"] = str(ROOT / "constraints.txt")
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """ddplab's wheel, built from this checkout once."""
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(dist), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    return next(dist.glob("ddplab-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory, record_testsuite_property):
    """(python of a fresh venv holding only what ``pip install <wheel>`` put there, a folder
    outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    venv.EnvBuilder(with_pip=True).create(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    began = time.monotonic()
    # --no-compile: no .pyc written for torch's thousands of modules at install (Python writes
    # each one when it is first imported, as anywhere); it saves the install's CPU, not the point
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", str(wheel)],
                          capture_output=True, text=True, timeout=600, env=_user_env())
    assert done.returncode == 0, done.stdout + done.stderr
    record_testsuite_property("wheel_student_install_s", round(time.monotonic() - began, 1))
    work = tmp / "user"
    work.mkdir()
    return python, work


def _run(installed, *args, timeout=300):
    python, work = installed
    ddplab = python.parent / "ddplab"
    return subprocess.run([str(ddplab), *args], cwd=work, env=_user_env(), capture_output=True, text=True,
                          timeout=timeout)


def _python(installed, code: str, timeout=120) -> subprocess.CompletedProcess:
    python, work = installed
    return subprocess.run([str(python), "-c", code], cwd=work, env=_user_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_the_environment_holds_the_wheel_and_a_students_profile_only(installed):
    python, _ = installed
    code = ("import importlib.metadata as m, re, ddplab; print(ddplab.__file__)\n"
            "for r in m.requires('ddplab'):\n"
            "    if 'extra ==' in r: continue\n"
            "    name = re.split(r'[=<>!~\\[ ;]', r)[0]\n"
            "    print('requires', name, m.version(name))\n"
            "for d in m.distributions():\n"
            "    print('installed', d.metadata['Name'].lower().replace('_', '-'))\n")
    out = _python(installed, code)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith(str(python.parent.parent)) and "site-packages" in first, first
    assert not first.startswith(str(ROOT))
    required = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("requires ")}
    assert {"torch", "ipyparallel", "jupyterlab", "scikit-learn", "matplotlib"} <= required
    present = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("installed ")}
    assert not present & set(NOT_A_STUDENTS), f"a student's install holds {present & set(NOT_A_STUDENTS)}"


def test_doctor_runs_from_the_installed_package(installed):
    result = _run(installed, "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-test   ok: 2 ranks, backend gloo, all_reduce correct" in result.stdout


@pytest.fixture(scope="module")
def course(installed) -> Path:
    """``ddplab notebooks course``: the student notebooks, as a student makes them from the wheel."""
    _, work = installed
    student = _run(installed, "notebooks", "course")
    assert student.returncode == 0, student.stderr
    return work / "course"


def test_notebooks_writes_the_student_notebooks_and_their_lab_settings(course):
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in course.glob("*.ipynb")) == shipped
    setup = (course / "00_setup.ipynb").read_text()
    assert "NotImplementedError" in setup and "BEGIN SOLUTION" not in setup
    page = json.loads((course / ".jupyter" / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"]["@jupyter/nbgrader"] is True


def _run_cells(installed, notebook: Path, stop_id: str) -> list:
    """The code cells of ``notebook`` before ``stop_id``, run in the venv's own kernel, then the
    probe cell (tests/run_cells.py): the executed cells."""
    python, work = installed
    out = notebook.with_suffix(".out.ipynb")
    ran = subprocess.run([str(python), str(RUN_CELLS), str(notebook), stop_id, str(out)], cwd=work,
                         env=_user_env(), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]


def _probe_says_the_venv(installed, probe) -> None:
    python, _ = installed
    printed = "".join(o.get("text", "") for o in probe.outputs).split()
    assert printed[:1] == [str(python)], f"the kernel is not the venv's: {probe.outputs}"
    assert printed[1].startswith(str(python.parent.parent)), f"ddplab from elsewhere: {printed}"


def _errors(cell) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error"]


def _ignores_output(cell) -> bool:
    return (bool(dict(find_comment_markers(cell.source)).get("ignore_output"))
            or "nbval-ignore-output" in cell.metadata.get("tags", []))


@pytest.mark.parametrize("name", sorted(OPENING))
def test_a_student_notebooks_opening_sections_run_on_2_ranks(installed, course, name):
    cells = _run_cells(installed, course / name, OPENING[name])
    *ran, probe = cells
    reference = [c for c in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
                 if c.cell_type == "code"][:len(ran)]
    assert [c.source for c in ran] == [c.source for c in reference], "the student copy's cells moved"
    assert "2 ranks ready" in "".join(o.get("text", "") for o in ran[0].outputs), ran[0].outputs
    patterns = sanitize_patterns()
    wrong = []
    for index, (got, want) in enumerate(zip(ran, reference)):
        wrong += [f"code cell {index}: {e}" for e in _errors(got)]
        if not _ignores_output(want) and not _errors(got):
            differs = difference(want.outputs, got.outputs, patterns)
            if differs:
                wrong.append(f"code cell {index} ({got.source.splitlines()[0]!r}): {differs}")
    assert not wrong, "\n".join(wrong)
    _probe_says_the_venv(installed, probe)


def test_the_setup_cell_installs_a_missing_ddplab_with_pip_and_says_so_in_one_line(installed, course, wheel):
    python, _ = installed
    removed = subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "ddplab"],
                             capture_output=True, text=True, timeout=120, env=_user_env())
    assert removed.returncode == 0, removed.stderr
    assert "ModuleNotFoundError" in _python(installed, "import ddplab").stderr
    after_setup = "cell-03"                            # notebook 00's cell after its set-up cell

    # No ddplab on the index and no wheel at hand: pip's own words, then the import's error.
    setup, probe = _run_cells(installed, course / "00_setup.ipynb", after_setup)
    shown = "".join(o.get("text", "") for o in setup.outputs)
    assert "No matching distribution found for ddplab" in shown, setup.outputs
    assert _errors(setup) == ["ModuleNotFoundError: No module named 'ddplab'"], setup.outputs

    # The wheel beside the notebook, as a student uploads it: installed, and said in one line.
    shutil.copy(wheel, course / wheel.name)
    setup, probe = _run_cells(installed, course / "00_setup.ipynb", after_setup)
    assert not _errors(setup), setup.outputs
    lines = "".join(o.get("text", "") for o in setup.outputs).splitlines()
    version = wheel.name.split("-")[1]
    assert lines[0] == SAYS_INSTALLED.format(version=version), lines
    assert len(lines) == 2 and lines[1].startswith("ddplab: 2 ranks ready"), lines
    _probe_says_the_venv(installed, probe)


def test_grade_asks_for_its_extra_then_release_and_grade_run_from_the_installed_package(installed, wheel):
    python, work = installed
    reference = _run(installed, "notebooks", "reference", "--reference")
    assert reference.returncode == 0, reference.stderr
    assert "BEGIN SOLUTION" in (work / "reference" / "00_setup.ipynb").read_text()
    student = _run(installed, "notebooks", "fresh")
    assert student.returncode == 0, student.stderr

    # alice hands in the reference (every answer right), bob the untouched student version
    for who, folder in (("alice", "reference"), ("bob", "fresh")):
        (work / "submitted" / who).mkdir(parents=True)
        (work / "submitted" / who / "00_setup.ipynb").write_text(
            (work / folder / "00_setup.ipynb").read_text())
    refused = _run(installed, "grade", "submitted", "--csv", "grades.csv")
    assert refused.returncode == 2 and "pip install 'ddplab[grade]'" in refused.stderr, refused
    extra = subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[grade]"],
                           capture_output=True, text=True, timeout=600, env=_user_env())
    assert extra.returncode == 0, extra.stdout + extra.stderr

    released = _run(installed, "release", "reference", "-o", "released")
    assert released.returncode == 0, released.stderr
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in (work / "released").glob("*.ipynb")) == shipped

    graded = _run(installed, "grade", "submitted", "--csv", "grades.csv", timeout=600)
    assert graded.returncode == 1, graded.stdout + graded.stderr     # bob did not pass
    rows = {line.split(",")[0]: line for line in (work / "grades.csv").read_text().splitlines()}
    assert rows["alice"].startswith("alice,00_setup,1,1,1,"), rows
    assert rows["bob"].startswith("bob,00_setup,0,0,1,"), rows


def _solution_blocks() -> list[str]:
    """Every solution of the course, as the lines between its markers (blank lines left out)."""
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


def _ddplabs_files(installed) -> list[Path]:
    """Every file the wheel installed (its RECORD), and whatever is in the package's folder now."""
    code = ("import importlib.metadata as m, pathlib, ddplab\n"
            "for f in m.files('ddplab'): print(f.locate().resolve())\n"
            "for p in pathlib.Path(ddplab.__file__).parent.rglob('*'): print(p.resolve())\n")
    listed = _python(installed, code)
    assert listed.returncode == 0, listed.stderr
    return sorted({Path(line) for line in listed.stdout.splitlines()})


def _texts_of(paths: list[Path]):
    """(path, its text with every line stripped) for each file of ``paths``; a notebook's
    text is its cells' sources (its JSON splits a block over quoted lines). Only ddplab's
    own files: the dependencies (torch's thousands) cannot hold the course's solutions."""
    for path in paths:
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
    files = _ddplabs_files(installed)
    assert any(p.suffix == ".ipynb" for p in files) and any(p.name == "RECORD" for p in files), files[:5]
    before = [b for b in blocks if any(b in text for _, text in _texts_of(files))]
    assert len(before) == len(blocks), "the wheel ships the reference notebooks"

    done = _run(installed, "remove-solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "carries no solutions now" in done.stdout
    found = {str(path.relative_to(python.parent.parent.resolve())): block[:60]
             for path, text in _texts_of(_ddplabs_files(installed)) for block in blocks if block in text}
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
    asked = _python(installed, code)
    assert asked.stdout.startswith("Hint for ping-pong (01_point_to_point.ipynb): "), asked
    assert "CourseError ddplab: ddplab.solution('ping-pong'): this installation has no solutions" \
        in asked.stdout, asked.stdout
    for args in (["notebooks", "ref", "--reference"], ["grade", "submitted"]):
        refused = _run(installed, *args)
        assert refused.returncode == 2 and "removed for a graded term" in refused.stderr, refused
