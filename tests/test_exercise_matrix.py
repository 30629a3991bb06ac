"""tools/exercise_matrix.py: the exercises read from notebooks, the marks read from tests, no test run.

A tiny repository in a temporary folder: one notebook with two check cells, and a
test module whose marks cover the first exercise completely and the second partly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import exercise_matrix  # noqa: E402

NOTEBOOK = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
    {"cell_type": "code", "id": "check-ring", "metadata": {"tags": ["check"]}, "outputs": [],
     "execution_count": None, "source": ["ddplab.check.ring_token()"]},
    {"cell_type": "code", "id": "check-swap", "metadata": {"tags": ["check"]}, "outputs": [],
     "execution_count": None, "source": ["ddplab.check.swap_tensors(swap)\n"]},
    {"cell_type": "code", "id": "not-a-check", "metadata": {}, "outputs": [], "execution_count": None,
     "source": ["ddplab.check.values_on_ranks('x')"]},
]}
TESTS = '''import pytest

pytestmark = pytest.mark.exercise("ring_token", "stub")


@pytest.mark.exercise("ring_token", "mistake", "nothing passed")
@pytest.mark.exercise("ring_token", "mistake", "the other way round")
@pytest.mark.exercise("swap_tensors", "mistake", "its own tensor")
def test_mistakes():
    pass


class TestRing:
    @pytest.mark.exercise("ring_token", "bypass")
    @pytest.mark.exercise("ring_token", "alternative", cell="check-ring")
    def test_more(self):
        pass
'''


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_p2p.ipynb").write_text(json.dumps(NOTEBOOK))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_p2p.py").write_text(TESTS)
    return tmp_path


def test_a_complete_and_an_incomplete_row(repo, capsys):
    rows, problems = exercise_matrix.matrix(repo)
    assert problems == []
    assert [(r.checker, r.cell) for r in rows] == [("ring_token", "check-ring"),
                                                  ("swap_tensors", "check-swap")]
    ring, swap = rows
    assert ring.missing() == [] and len(ring.covered["mistake"]) == 2
    assert len(ring.covered["stub"]) == 2           # the module's pytestmark covers both of its tests
    assert swap.missing() == ["stub", "mistake", "bypass", "alternative"]
    assert len(swap.covered["mistake"]) == 1         # one mistake of the two needed
    assert exercise_matrix.main(["--root", str(repo)]) == 1
    out, err = capsys.readouterr()
    assert "ring_token (check-ring)" in out and "  yes" in out and "  no" in out
    assert "2 exercises, 1 complete, 1 incomplete" in out
    assert 'first: swap_tensors in 01_p2p: stub, mistake, bypass, alternative' in err
    assert exercise_matrix.main(["--root", str(repo), "--allow-incomplete"]) == 0


def test_a_mark_that_names_no_exercise_or_kind_fails_even_when_allowed(repo, capsys):
    (repo / "tests" / "test_typo.py").write_text(
        'import pytest\n\n\n@pytest.mark.exercise("ring_tokn", "mistake")\n'
        '@pytest.mark.exercise("ring_token", "mistakes")\n'
        '@pytest.mark.exercise("ring_token", "stub", cell="check-nothing")\n'
        '@pytest.mark.exercise("ring_token")\ndef test_typo():\n    pass\n')
    _, problems = exercise_matrix.matrix(repo)
    assert any("tests/test_typo.py:4: exercise 'ring_tokn' not found (no check cell calls "
               "ddplab.check.ring_tokn)" in p for p in problems), problems
    assert any("kind 'mistakes' is not one of stub, mistake, bypass, alternative" in p for p in problems)
    assert any("exercise 'ring_token' cell 'check-nothing' not found" in p for p in problems)
    assert any('write @pytest.mark.exercise("checker", "kind"' in p for p in problems)
    assert exercise_matrix.main(["--root", str(repo), "--allow-incomplete"]) == 1


def test_every_mark_in_this_repository_names_a_real_exercise():
    rows, problems = exercise_matrix.matrix(ROOT)
    assert problems == []
    assert len(rows) == len({(r.notebook, r.cell) for r in rows}) >= 75   # a row per check cell


def test_the_command_runs_without_pytest_and_prints_the_table():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "exercise_matrix.py"), "--allow-incomplete",
                             "--notebook", "02_"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "global_mean (check-global-mean)" in result.stdout
