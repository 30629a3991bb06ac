"""`ddplab doctor` as a user runs it: a real subprocess that starts and stops a real lab."""

import subprocess
import sys


def test_doctor_reports_and_self_tests():
    result = subprocess.run([sys.executable, "-m", "ddplab.cli", "doctor"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "torch       2.13.0" in out
    assert "gloo" in out.split("backends")[1].splitlines()[0]
    assert "GPUs" in out
    assert "self-test   ok: 2 ranks, backend gloo, all_reduce correct" in out
