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
        "ddplab/rank/guard.py": "import ddplab.lab\n",
        "ddplab/rank/typed.py": "from typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from ddplab.lab.cluster import Lab\n",
    })
    found = "\n".join(check_layout.problems(root))
    assert "ddplab/rank/engine.py:3: imports ddplab.lab.cluster: code under ddplab.rank runs " \
           "in an engine and never imports the kernel-side ddplab.lab" in found
    assert "ddplab/rank/guard.py:1: imports ddplab.lab:" in found
    assert "lab/cluster.py" not in found and "typed.py" not in found and "procs" not in found
