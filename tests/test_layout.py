"""The layout rules (tools/check_layout.py) and the linter hold for the whole checkout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def check_layout():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import check_layout
        yield check_layout
    finally:
        sys.path.remove(str(ROOT / "tools"))


def test_the_checkout_keeps_the_layout_rules(check_layout):
    assert check_layout.problems() == []


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A checkout under ``tmp_path``; an empty ``ddplab/__init__.py`` lists every top-level module
    as a teaching module, so a test of another rule sees only that rule's breaches."""
    if files.get("ddplab/__init__.py") == "":
        top = [Path(n).stem for n in files
               if n.startswith("ddplab/") and n.count("/") == 1 and n.endswith(".py")]
        files = {**files, "ddplab/__init__.py": '"""Teaching modules: '
                 + ", ".join(f"``{name}``" for name in top if name != "__init__") + '."""\n'}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in ("tests", "tools", "benchmarks"):
        (tmp_path / folder).mkdir(exist_ok=True)
    return tmp_path


def test_the_checker_sees_each_kind_of_breach(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs.py": "import os\ndef end(pid):\n    os.kill(pid, 9)\n",
        "ddplab/a.py": "from .b import _hidden\nfrom . import c\nx = c._state\n",
        "ddplab/b.py": "def f():\n    from . import a\n_hidden = 1\n",
        "ddplab/c.py": "_state = {}\n",
        "ddplab/pkg/__init__.py": "",
        "ddplab/pkg/_core.py": "def helper(): pass\n",
        "ddplab/pkg/user.py": "from ._core import helper\n",          # allowed: its package
        "ddplab/outsider.py": "from .pkg._core import helper\n",
        "tests/test_x.py": "def test(p):\n    p.kill()\n",
    })
    found = "\n".join(check_layout.problems(root))
    assert "ddplab/a.py:1: imports private name _hidden of ddplab.b" in found
    assert "ddplab/a.py:3: reads private ddplab.c._state" in found
    assert "ddplab/outsider.py:1: imports private module ddplab.pkg._core" in found
    assert "pkg/user.py" not in found and "ddplab/procs.py" not in found
    assert "tests/test_x.py:2: .kill() outside ddplab.procs" in found
    assert "import cycle: ddplab.a -> ddplab.b (line 1); ddplab.b -> ddplab.a (line 2)" in found


def test_only_procs_starts_processes_with_popen(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs/__init__.py": "from .tree import start\n",
        "ddplab/procs/tree.py": "import subprocess\ndef start(c):\n    return subprocess.Popen(c)\n",
        "ddplab/a.py": "import subprocess as sp\np = sp.Popen(['true'])\n",
        "ddplab/b.py": "from subprocess import Popen\n",
        "ddplab/c.py": "def f(Popen):\n    return Popen(['true'])\n",
        "ddplab/words.py": '"""Never Popen here: use procs."""\n# Popen in a comment\n'
                           "def _popen(launcher):\n    return launcher.process\n",
    })
    found = "\n".join(check_layout.problems(root))
    assert "ddplab/a.py:2: sp.Popen outside ddplab.procs: run commands with ddplab.procs.Group" \
        in found
    assert "ddplab/b.py:1: from subprocess import Popen outside ddplab.procs" in found
    assert "ddplab/c.py:2: Popen outside ddplab.procs" in found
    assert "words.py" not in found and "procs/tree.py" not in found, found


def test_rank_code_never_imports_the_kernel_side(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs.py": "",
        "ddplab/lab/__init__.py": "",
        "ddplab/lab/cluster.py": "from ..rank import engine\n",       # allowed: lab uses rank
        "ddplab/rank/__init__.py": "",
        "ddplab/rank/engine.py": "from ddplab import procs\n"
                                 "def late():\n    from ..lab import cluster\n",
        "ddplab/rank/tether.py": "import ddplab.lab\n",
        "ddplab/rank/typed.py": "from typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from ddplab.lab.cluster import Lab\n",
    })
    found = "\n".join(check_layout.problems(root))
    assert "ddplab/rank/engine.py:3: imports ddplab.lab.cluster: code under ddplab.rank runs " \
           "in an engine and never imports the kernel-side ddplab.lab" in found
    assert "ddplab/rank/tether.py:1: imports ddplab.lab:" in found
    assert "lab/cluster.py" not in found and "typed.py" not in found and "procs" not in found


def test_nothing_derives_from_lab(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs.py": "",
        "ddplab/lab/__init__.py": "",
        "ddplab/lab/lab.py": "class Lab:\n    pass\n",
        "ddplab/lab/multihost.py": "from . import lab\nclass HostLab(lab.Lab):\n    pass\n",
        "ddplab/lab/local.py": "class LocalRanks:\n    pass\n",     # composed: allowed
    })
    found = "\n".join(check_layout.problems(root))
    assert "ddplab/lab/multihost.py:2: class HostLab(lab.Lab) derives from Lab: compose a lab " \
           "from a Ranks instead" in found
    assert "local.py" not in found and "lab/lab.py" not in found, found


def test_the_top_level_is_the_listed_teaching_modules(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": '"""The package.\n\nTeaching modules, which notebooks import: '
                              '``show``,\n``train``, ``gone``.\n\nNot ``hidden``: a later paragraph."""\n',
        "ddplab/__main__.py": "",
        "ddplab/errors.py": "", "ddplab/limits.py": "", "ddplab/text.py": "",  # infrastructure
        "ddplab/procs.py": "",
        "ddplab/show.py": "", "ddplab/train.py": "",
        "ddplab/hidden.py": "",                       # not listed: a breach
        "ddplab/lab/__init__.py": "", "ddplab/lab/helper.py": "",              # in a package: fine
    })
    found = check_layout.problems(root)
    assert "ddplab/hidden.py: a top-level module that ddplab/__init__.py's docstring does not list " \
           "among its Teaching modules: list it there if notebooks import it" in "\n".join(found)
    assert "ddplab/__init__.py: its docstring lists 'gone' among its Teaching modules, but there " \
           "is no ddplab/gone.py" in found
    assert len(found) == 2, found


def test_the_top_level_must_be_listed(check_layout, tmp_path):
    root = _tree(tmp_path, {"ddplab/__init__.py": '"""No list here."""\n', "ddplab/procs.py": ""})
    assert check_layout.problems(root) == [
        "ddplab/__init__.py: its docstring has no 'Teaching modules' paragraph listing the top-level "
        "modules that notebooks may import (``name``, ``name``, ...)"]


def test_no_module_is_over_the_size_cap(check_layout, tmp_path):
    cap = check_layout.MAX_LINES
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs.py": "",
        "ddplab/at_cap.py": "x = 1\n" * cap,
        "ddplab/lab/__init__.py": "",
        "ddplab/lab/long.py": "x = 1\n" * (cap + 1),
    })
    assert check_layout.problems(root) == [
        f"ddplab/lab/long.py: {cap + 1} lines, over the cap of {cap}: split it by what it does"]


def test_no_test_file_is_over_the_size_cap(check_layout, tmp_path):
    cap = check_layout.MAX_LINES
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs.py": "",
        "tests/test_at_cap.py": "x = 1\n" * cap,
        "tests/test_long.py": "x = 1\n" * (cap + 1),
        "tests/kit/helpers.py": "x = 1\n" * (cap + 2),      # a helper module, in a folder
    })
    assert check_layout.problems(root) == [
        f"tests/kit/helpers.py: {cap + 2} lines, over the cap of {cap}: split it by what it does",
        f"tests/test_long.py: {cap + 1} lines, over the cap of {cap}: split it by what it does"]


def test_only_procs_runs_commands_with_subprocess(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs/__init__.py": "from .tree import run_command\n",
        "ddplab/procs/tree.py": "import subprocess\ndef run_command(c, timeout):\n"
                                "    return subprocess.run(c, timeout=timeout)\n",
        "ddplab/a.py": "import subprocess\nout = subprocess.run(['true'], timeout=5)\n",
        "ddplab/b.py": "import subprocess as sp\nsp.check_output(['true'])\n",
        "ddplab/c.py": "from subprocess import call\n",
        "ddplab/fine.py": '"""subprocess.run(...) named in words is fine."""\nimport subprocess\n'
                          "from . import procs\n"
                          "try:\n    procs.run_command(['true'], timeout=5, stdin=subprocess.DEVNULL)\n"
                          "except subprocess.TimeoutExpired:\n    pass\n",
    })
    found = "\n".join(check_layout.problems(root))
    assert "ddplab/a.py:2: subprocess.run outside ddplab.procs: run a short command to its end with " \
           "ddplab.procs.run_command" in found
    assert "ddplab/b.py:2: sp.check_output outside ddplab.procs" in found
    assert "ddplab/c.py:1: from subprocess import call outside ddplab.procs" in found
    assert "fine.py" not in found and "procs/tree.py" not in found, found


def test_a_name_stands_once_unless_its_twin_has_a_reason(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/procs.py": "",
        "ddplab/hosts.py": "",                          # a module and a package of one name
        "ddplab/lab/__init__.py": "",
        "ddplab/lab/hosts/__init__.py": "",
        "ddplab/lab/ranks.py": "", "ddplab/lab/hosts/ranks.py": "",        # two modules
        "ddplab/lab/flight.py": "", "ddplab/rank/__init__.py": "",
        "ddplab/rank/flight.py": "",                    # in TWINS: one mechanism's two sides
    })
    found = check_layout.problems(root)
    assert found == [
        "ddplab/hosts.py and ddplab/lab/hosts/: one name in two folders; rename one so the name "
        "says which room it is in, or list it in TWINS with the reason",
        "ddplab/lab/hosts/ranks.py and ddplab/lab/ranks.py: one name in two folders; rename one "
        "so the name says which room it is in, or list it in TWINS with the reason"], found
    assert all(reason for reason in check_layout.TWINS.values())


def _notebook(*cells: str) -> str:
    import json
    return json.dumps({"cells": [{"cell_type": "code", "source": cell.splitlines(True)}
                                 for cell in cells] + [{"cell_type": "markdown",
                                                        "source": "from ddplab.rank import x"}]})


def test_notebooks_import_only_the_public_api(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": '"""Teaching modules: ``show``, ``launch``, ``env``."""\n',
        "ddplab/procs.py": "", "ddplab/show.py": "", "ddplab/env.py": "",
        "ddplab/launch/__init__.py": "", "ddplab/launch/job.py": "",
        "ddplab/check/__init__.py": "", "ddplab/check/p2p.py": "",
        "ddplab/rank/__init__.py": "", "ddplab/rank/output.py": "",
        "notebooks/01_ok.ipynb": _notebook(
            "import ddplab\nfrom ddplab import show, launch\nfrom ddplab.launch import report_env",
            "%%ranks\nimport ddplab.env\nddplab.check.ring_token()",
            "!ls\nawait something()\nfrom ddplab.show import show as s"),
        "notebooks/02_bad.ipynb": _notebook(
            "def f():\n    from ddplab.rank.output import hide_fd_output\n    return 1",
            "%%rank 0\nfrom ddplab.launch import job\nimport ddplab.check.p2p"),
    })
    # This tree's check/ is not cut by notebook (rule 10 says so); only the imports are read here.
    found = [p for p in check_layout.problems(root) if p.startswith("notebooks/")]
    words = ("which is not ddplab's public API (ddplab, a teaching module that ddplab/__init__.py's "
             "docstring lists, or ddplab.check): import it from a teaching module, or move what it "
             "needs into one")
    assert found == [f"notebooks/02_bad.ipynb: cell 0 imports ddplab.rank.output, {words}",
                     f"notebooks/02_bad.ipynb: cell 1 imports ddplab.launch.job, {words}",
                     f"notebooks/02_bad.ipynb: cell 1 imports ddplab.check.p2p, {words}"], found


def test_a_module_is_teaching_or_infrastructure_never_both(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": '"""Teaching modules: ``errors``."""\n',
        "ddplab/procs.py": "", "ddplab/errors.py": "",
    })
    assert check_layout.problems(root) == [
        "ddplab/errors.py: listed both as a teaching module and as infrastructure: it is one or "
        "the other"]


def test_the_notebooks_known_deeper_imports_each_have_a_reason(check_layout):
    assert all(reason for reason in check_layout.NOTEBOOK_IMPORTS.values())


def test_the_checkers_are_cut_by_notebook(check_layout, tmp_path):
    root = _tree(tmp_path, {
        "ddplab/__init__.py": "",
        "ddplab/check/__init__.py": 'NOTEBOOKS = ("nb00_setup",)\n',
        "ddplab/check/_core.py": "",                               # shared, private: fine
        "ddplab/check/nb00_setup.py": "",
        "ddplab/check/collectives.py": "",                         # no notebook in its name
        "notebooks/00_setup.ipynb": "{}",
        "notebooks/01_point_to_point.ipynb": "{}",                 # no checkers of its own
    })
    found = check_layout.checker_problems(root)
    assert any("ddplab/check/collectives: a public checker module not named for a notebook" in p
               for p in found), found
    assert any("no checker module for notebooks/01_point_to_point.ipynb" in p for p in found), found
    assert any("NOTEBOOKS must list every notebook's checker module, in course order: nb00_setup, "
               "nb01_point_to_point; it lists nb00_setup" in p for p in found), found
    assert not any("_core" in p for p in found), found
    (root / "ddplab/check/collectives.py").unlink()
    (root / "ddplab/check/nb01_point_to_point").mkdir()
    (root / "ddplab/check/nb01_point_to_point/__init__.py").write_text("")   # a package is fine
    (root / "ddplab/check/__init__.py").write_text(
        'NOTEBOOKS = ("nb00_setup", "nb01_point_to_point")\n')
    assert check_layout.checker_problems(root) == []

