"""A container without namespaces (Colab, Kaggle, Docker's defaults): no user namespaces, no
network namespaces, no capabilities. A lab still starts and says once that its ranks share the
machine's network; cells, the timeline and grading work, grading unsandboxed with its one line.

The test makes such a container here: a user namespace whose limit on further user namespaces is
spent (``max_user_namespaces``), and in it the command as a user without capabilities, so
neither ``unshare``, the lab's private network nor bubblewrap can be had (issue 44).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from hostile import attacks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAB = r'''
import json, subprocess, ddplab
denied = [subprocess.run(["unshare", flag, "true"], capture_output=True).returncode != 0
          for flag in ("-U", "-n")]
with ddplab.start(world_size=2) as lab:
    said = lab.describe()
    with lab.trace() as tr:
        lab.run_cell("x = torch.ones(1) * (rank + 1)\ndist.all_reduce(x)\nsums = x.item()")
    sums = lab.run(lambda: __import__("ddplab.rank.engine", fromlist=["namespace"]).namespace()["sums"])
print(json.dumps({"denied": denied, "said": said, "sums": sums,
                  "ops": sorted({e.op for e in tr.events})}))
'''


def _without_namespaces(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``command`` in a user namespace that allows no other, as a user without capabilities."""
    inner = " ".join(f"'{part}'" for part in command)
    return subprocess.run(
        ["unshare", "-U", "-r", "sh", "-c", "echo 1 > /proc/sys/user/max_user_namespaces && "
         f"exec unshare -U --map-user=65534 --map-group=65534 {inner}"],
        cwd=cwd, capture_output=True, text=True, timeout=500)


def test_a_lab_cells_and_the_timeline_work_and_say_the_network_is_shared(tmp_path):
    done = _without_namespaces([sys.executable, "-c", LAB], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["denied"] == [True, True]                 # really no namespace to be had
    assert seen["sums"] == [3.0, 3.0]
    assert "all_reduce" in seen["ops"]
    lines = seen["said"].splitlines()
    assert lines[0].startswith("2 ranks ready") and len(lines) == 2, seen["said"]
    assert "the ranks share this machine's network, because" in lines[1]


def test_grading_runs_unsandboxed_and_says_so_once(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "sub" / "alice").mkdir(parents=True)
    nbformat.write(attacks.reference(), tmp_path / "ref" / "00_setup.ipynb")
    (tmp_path / "sub" / "alice" / "00_setup.ipynb").write_text(attacks.submission(
        "honest", marker="unused", reference="/nowhere", other="/nowhere", csv="/nowhere"))
    done = _without_namespaces([sys.executable, "-m", "ddplab", "grade", "sub", "--reference", "ref",
                                "--csv", "grades.csv"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr.count("grading WITHOUT a sandbox (bwrap cannot make a sandbox here") == 1, \
        done.stderr
    assert (tmp_path / "grades.csv").read_text().splitlines()[1].startswith("alice,00_setup,1,1,")
