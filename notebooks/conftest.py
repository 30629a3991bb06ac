"""nbval's notebooks run under the suite's leak check (``tests/leakcheck.py``) too:
a notebook whose run leaves a ``ddplab-*`` entry in the temporary folder, or a
live process, fails at its end, named."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import leakcheck  # noqa: E402


def pytest_configure(config) -> None:
    leakcheck.install(config)
