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
