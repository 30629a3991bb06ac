"""The project's own install files agree with each other."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_names_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda_side = {_name(r) for r in pip_section if not r.startswith("-e")}
    assert conda_side == declared


def test_environment_yml_uses_the_constraint_pins():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    for requirement in pip_section:
        if "==" in requirement:
            name, version = requirement.split("==")
            assert pins[name] == version, f"{name}: environment.yml {version}, constraints {pins[name]}"
    assert pins["torch"] == "2.13.0"


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text()[:1200]
    assert "make lab" in head and "make test" in head


def test_ci_runs_make_test_and_nothing_else():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert lines == ["make test"]


def _imports(tree) -> list[tuple[str, bool]]:
    """(top-level module, whether imported inside a function) for every absolute import."""
    import ast
    found = []

    def visit(node, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def test_every_import_of_the_package_is_declared():
    """Each third-party module ddplab imports (anywhere, even inside a function) comes from
    a distribution pyproject.toml lists as a dependency: a pip user gets it. The one
    exception is the ``grade`` extra (nbval): imported only inside functions of
    ``ddplab/grade/``, which ``ddplab grade`` reaches after ``require_nbval`` said the fix."""
    import ast
    import importlib.metadata
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    grading = {_name(r) for r in project["optional-dependencies"]["grade"]}
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in (ROOT / "ddplab").rglob("*.py"):
        where = path.relative_to(ROOT)
        for top, in_function in _imports(ast.parse(path.read_text())):
            if top in sys.stdlib_module_names or top in ("ddplab", "__main__"):
                continue
            dists = {_name(d) for d in providers.get(top, [top])}
            # a module some declared package brings along (torch brings sympy, ...) still
            # counts as undeclared: ddplab must name what it imports
            if dists & declared:
                continue
            if dists & grading and in_function and where.parts[:2] == ("ddplab", "grade"):
                continue
            undeclared.setdefault(top, []).append(str(where))
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def test_the_checker_of_imports_tells_a_lazy_import_from_a_module_level_one():
    import ast
    tree = ast.parse("import nbval\nfrom os import path\ndef f():\n    from nbval.plugin import x\n")
    assert _imports(tree) == [("nbval", False), ("os", False), ("nbval", True)]


# What a student never needs: the instructor's and the tests' tools (issue 57).
NOT_A_STUDENTS = {"nbgrader", "jupyterhub", "playwright", "pytest", "pytest-timeout", "nbval", "ruff",
                  "mkdocs", "mkdocs-material", "mkdocs-jupyter", "mkdocstrings-python", "pyyaml"}


def test_the_student_profile_leaves_the_instructor_and_test_tools_to_the_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    student = {_name(r) for r in project["dependencies"]}
    extras = {name: {_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    assert not student & NOT_A_STUDENTS, student & NOT_A_STUDENTS
    assert NOT_A_STUDENTS <= extras["instructor"] | extras["docs"] | extras["test"]
    assert extras["grade"] <= extras["instructor"]
    pins = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    unpinned = (student | set().union(*extras.values())) - pins
    assert not unpinned, f"not pinned in constraints.txt: {unpinned}"


def _make_n(venv: Path, target: str) -> str:
    """What ``make target`` would run with .venv at ``venv`` (-n: printed, not run). Run from
    ``make test`` too: the outer make's flags stay out, and so do its directory lines."""
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={venv}", target], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_each_make_target_installs_its_profile_and_the_stamps_tell_them_apart(tmp_path):
    venv = tmp_path / "venv"
    installs = {target: [line for line in _make_n(venv, target).splitlines() if "pip install" in line
                         and "-c constraints.txt" in line]
                for target in ("lab", "workspace", "lab-reference", "docs", "test", "test-fast", "install")}
    wanted = {"lab": "-e '.'", "workspace": "-e '.'", "lab-reference": "-e '.[instructor]'",
              "docs": "-e '.[docs]'", "test": "-e '.[instructor,docs,test]'",
              "test-fast": "-e '.[instructor,docs,test]'", "install": "-e '.[instructor,docs,test]'"}
    for target, option in wanted.items():
        assert len(installs[target]) == 1 and installs[target][0].endswith(option), (target, installs)

    # a .venv that `make lab` installed: make lab installs nothing more, make test the extras
    venv.mkdir()
    (venv / ".installed-student").touch()
    assert "pip install" not in _make_n(venv, "lab")
    assert "-e '.[instructor,docs,test]'" in _make_n(venv, "test")
    # and one that `make test` installed holds every profile
    for profile in ("student", "instructor", "docs", "test"):
        (venv / f".installed-{profile}").touch()
    assert all("pip install" not in _make_n(venv, t) for t in ("lab", "lab-reference", "docs", "test"))


def test_make_lab_serves_the_workspace_with_the_settings_ddplab_notebooks_writes(tmp_path):
    from ddplab.course.lab_settings import CONFIG_FOLDER
    commands = _make_n(tmp_path / "venv", "lab").splitlines()
    assert "ddplab notebooks workspace || test $? -eq 1" in commands[-2], commands   # exit 1: partly copied
    assert commands[-1].startswith(f'JUPYTER_CONFIG_PATH="{ROOT}/workspace/{CONFIG_FOLDER}"'), commands
    assert "jupyter lab --notebook-dir=workspace" in commands[-1]


def test_the_python_versions_claimed_are_those_tested():
    # tomllib (these tests) and the CI image need 3.11; 3.10 is not tested, so not claimed
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python>=3.11" in env["dependencies"]


# Every notebook's set-up cell opens with this: Colab, Kaggle or a JupyterHub has no ddplab
# until %pip installs it (tests/test_wheel.py runs it there, from the wheel); with ddplab
# present it prints nothing, so the stored output stays what nbval compares.
SETUP_GUARD = '''# NBVAL_IGNORE_OUTPUT
try:
    import ddplab
except ModuleNotFoundError:  # Colab, Kaggle, a JupyterHub: %pip installs it into this kernel,
    # from the package index or from a ddplab wheel put beside this notebook
    from IPython.utils.capture import capture_output
    with capture_output() as pip_log:
        %pip install --find-links . ddplab
    if "Successfully installed" not in pip_log.stdout:
        pip_log.show()  # pip's own words: why it could not
    import ddplab
    print(f"ddplab was not installed here: installed ddplab {ddplab.__version__} with %pip.")

'''


def test_every_notebooks_setup_cell_installs_ddplab_where_it_is_missing():
    import nbformat
    wrong = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        if not code[0].source.startswith(SETUP_GUARD):
            wrong.append(f"{path.name}: its first code cell does not open with the %pip guard")
        elif "ddplab.start(" not in code[0].source:
            wrong.append(f"{path.name}: its set-up cell starts no lab")
        elif any("%pip" in c.source for c in code[1:]):
            wrong.append(f"{path.name}: a second %pip cell")
    assert not wrong, "\n".join(wrong)
