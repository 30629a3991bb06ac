"""tools/gpu_check.sh, the one-shot GPU run (issue 45), as it behaves on a machine without a GPU.

Here it must check its own syntax, run the CPU half (``ddplab doctor``: a real
2-rank gloo lab), say that there is no GPU, and exit 0. A failed step must
show in the report and in the exit code, never stop the script silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _run(report: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(report)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable, **env})


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_without_a_gpu_the_cpu_half_runs_and_the_script_says_so(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script runs its GPU half here")
    done = _run(tmp_path / "report.txt")
    report = (tmp_path / "report.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr + report
    assert "== doctor: ok" in report and "self-test   ok: 2 ranks, backend gloo" in report
    assert "== no GPU: torch sees none here, so only the CPU half ran" in report
    assert "gpu_tests" not in report and "no GPU on this machine" in done.stdout


def test_a_failed_step_is_reported_and_fails_the_run(tmp_path):
    done = _run(tmp_path / "report.txt", PYTHON="/bin/false")
    report = (tmp_path / "report.txt").read_text()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "== doctor: FAILED (exit 1)" in report
