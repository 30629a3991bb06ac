"""The suite's leak check (``tests/leakcheck.py``) for every pytest run from here, notebooks too.

A notebook that nbval runs, like a test, fails at its end, named, when it leaves
a ``ddplab-*`` entry in the temporary folder or a live process. This file sits
at the top, not in ``notebooks/``: the tests import their helpers as ``from
conftest import ...``, and pytest keeps one module named ``conftest`` at a time,
the last one it loaded. Loaded first, this one leaves that name to
``tests/conftest.py`` (``tests/test_leakcheck.py`` checks a run of both folders).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

import leakcheck  # noqa: E402


def pytest_configure(config) -> None:
    leakcheck.install(config)
