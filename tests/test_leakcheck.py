"""The suite's leak check (tests/leakcheck.py) fails a test that leaves something behind, and names it.

An inner pytest runs a small module under the same check: one test leaves a
``ddplab-x`` folder, one leaves a process, one tidies up; and, through nbval,
a notebook that leaves a folder (checked as a whole, as its cells share a
kernel). The outer test reads the inner report: the culprits are named, the
tidy test passes, and nothing of theirs outlives the inner run.
"""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ddplab import procs

TESTS = Path(__file__).resolve().parent

INNER = '''
import subprocess, sys, tempfile

def test_leaves_a_folder():
    tempfile.mkdtemp(prefix="ddplab-x")

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])

def test_tidy():
    with tempfile.TemporaryDirectory(prefix="ddplab-y") as folder:
        assert folder
'''


@pytest.mark.slow       # an inner pytest run: seconds
def test_the_check_fails_a_test_that_leaks_and_names_it(tmp_path):
    import nbformat
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import tempfile\nfolder = tempfile.mkdtemp(prefix='ddplab-nb-')"),
        nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(notebook, tmp_path / "leaky.ipynb")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import leakcheck
        leakcheck.SETTLE_S = 1.0

        def pytest_configure(config):
            leakcheck.install(config)
        """))
    (tmp_path / "test_inner.py").write_text(INNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    ran = procs.run([[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                      "--nbval", "--rootdir", str(tmp_path), str(tmp_path)]], 120, env=env, cwd=str(tmp_path))
    report = ran[0].output
    assert ran[0].returncode == 1, report
    assert "5 passed, 3 errors" in report, report
    assert "ERROR at teardown of test_leaves_a_folder" in report, report
    assert "test_inner.py::test_leaves_a_folder left behind" in report and "ddplab-x" in report, report
    assert "test_inner.py::test_leaves_a_process left behind" in report, report
    assert "time.sleep(300)" in report, report
    assert "test_tidy left" not in report, report
    assert "leaky.ipynb left behind" in report and "ddplab-nb-" in report, report
    # The inner run had a temporary folder of its own, inside ours, and removed it.
    assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith("ddplab-suite-")]


@pytest.mark.slow       # an inner pytest run: seconds
def test_a_run_of_the_tests_and_the_notebooks_imports_the_tests_conftest():
    """``make test`` collects tests/ and notebooks/ in one run: ``from conftest import ...`` in a
    test module must find tests/conftest.py, not a conftest.py beside the notebooks (nor one
    at the top, which a rank importing a test's module would find first, in its working folder)."""
    ran = procs.run([[sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                      "tests/test_magics.py", "tests/test_late.py", "notebooks/00_setup.ipynb", "--nbval"]],
                    120, cwd=str(TESTS.parent))
    assert ran[0].returncode == 0, ran[0].output[-3000:]
    assert "notebooks/00_setup.ipynb::Cell 0" in ran[0].output, ran[0].output[-3000:]
