"""Multi-host starts that cannot work, and kernels that end, against real daemons (the
``realhosts`` tier: tests/realhosts.py's sshds in network namespaces, Slurm, Open MPI).

Starts that cannot work fail within 10 s with the cause; a killed kernel, and a kernel that
exits after a stop, a restart and failed starts, leave nothing behind: no process, no Slurm
job, no lab directory here or on the hosts. Each path's own lab: tests/test_realhosts_paths.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import alive as _alive
from realhosts import MPI_ROOT, gone_within as _gone_within

import ddplab

pytestmark = pytest.mark.realhosts


#: A Python without ddplab (nor mpi4py): Debian's own.
BARE_PYTHON = "/usr/bin/python3"


# ----------------------------------------------------------- starts that cannot work
def _fails_fast(tmp_path, monkeypatch, **kwargs) -> str:
    monkeypatch.setenv("DDPLAB_LOG_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(ddplab.DdplabError) as info:
        ddplab.start(world_size=2, backend="gloo", timeout=60, **kwargs)
    took = time.monotonic() - start
    message = str(info.value)
    assert took < 10, f"failed after {took:.1f} s: {message}"
    print(f"\nfailed after {took:.1f} s")
    return message


def _kept(message: str) -> str:
    path = message.rsplit("(kept in ", 1)[1].split(")", 1)[0]
    with open(path) as f:
        return f.read()


def test_ssh_without_ddplab_on_the_hosts_fails_fast_with_the_cause(ssh_hosts, tmp_path, monkeypatch):
    message = _fails_fast(tmp_path, monkeypatch, hosts=ssh_hosts.aliases, ssh_cmd=ssh_hosts.ssh_cmd,
                          remote_python=BARE_PYTHON)
    assert "No module named 'ddplab'" in message and "node-a" in message, message
    assert "No module named 'ddplab'" in _kept(message)


def test_ssh_to_a_host_that_does_not_resolve_says_what_ssh_said(ssh_hosts, tmp_path, monkeypatch):
    message = _fails_fast(tmp_path, monkeypatch, hosts=["node-a", "no-such-host"],
                          ssh_cmd=ssh_hosts.ssh_cmd)
    assert "Could not resolve hostname no-such-host" in message, message


def test_slurm_without_ddplab_fails_fast_with_the_jobs_log(slurm, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)      # the job gets our environment
    message = _fails_fast(tmp_path, monkeypatch, engines="slurm", remote_python=BARE_PYTHON)
    assert "Slurm job" in message and "No module named" in message, message
    assert "No module named" in _kept(message)
    assert _gone_within(slurm.squeue, 10) == []
    assert os.listdir(tmp_path) == [os.path.basename(_kept_path(message))]


def _kept_path(message: str) -> str:
    return message.rsplit("(kept in ", 1)[1].split(")", 1)[0]


def test_a_refused_sbatch_says_what_sbatch_said(slurm, tmp_path, monkeypatch):
    message = _fails_fast(tmp_path, monkeypatch, engines="slurm",
                          config={"SlurmEngineSetLauncher": {"queue": "no-such-partition"}})
    assert "sbatch" in message and "invalid partition" in message.lower(), message
    assert "invalid partition" in _kept(message).lower()


def test_mpi_needs_are_named_before_anything_starts():
    from realhosts import need_root
    need_root("mpiexec")
    with pytest.raises(ddplab.ConfigError, match="lacks mpi4py"):
        ddplab.start(world_size=2, engines="mpi", remote_python=BARE_PYTHON, config=MPI_ROOT)
    with pytest.raises(ddplab.ConfigError, match="--allow-run-as-root"):
        ddplab.start(world_size=2, engines="mpi")


# ----------------------------------------------------------- the kernel dies
KERNEL = textwrap.dedent("""
    import json, os, sys
    import ddplab
    kind, args = sys.argv[1], json.loads(sys.argv[2])
    lab = ddplab.start(world_size=2, backend="gloo", timeout=30, **args)
    dirs = [lab.engines.rank_directory(r) for r in range(lab.world_size)]
    print(json.dumps({"dir": lab.directory, "pids": lab.pids,
                      "remote": dirs + [os.path.dirname(d) for d in dirs]}), flush=True)
    os.kill(os.getpid(), 9)
""")


@pytest.mark.parametrize("kind", ["ssh", "slurm", "mpi"])
def test_a_killed_kernel_leaves_nothing(kind, request, tmp_path):
    if kind == "ssh":
        hosts = request.getfixturevalue("ssh_hosts")
        args = {"hosts": hosts.aliases[:1], "ssh_cmd": hosts.ssh_cmd}
    elif kind == "slurm":
        cluster = request.getfixturevalue("slurm")
        args = {"engines": "slurm"}
    else:
        from realhosts import need_root
        need_root("mpiexec")
        args = {"engines": "mpi", "config": MPI_ROOT}
    out = subprocess.run([sys.executable, "-c", KERNEL, kind, json.dumps(args)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-3000:]
    left = json.loads(out.stdout.strip().splitlines()[-1])
    # SSH engines lose their session, mpiexec's watcher sees the kernel gone, Slurm's engines
    # miss the controller's heartbeat (about 6 s; more on a loaded machine) and end their job.
    assert _gone_within(lambda: [p for p in left["pids"] if _alive(p)], 30) == []
    assert _gone_within(lambda: [d for d in [left["dir"], *left["remote"]] if os.path.exists(d)],
                        10) == []
    if kind == "slurm":
        assert _gone_within(cluster.squeue, 30) == []
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------- the kernel exits
EXITING = textwrap.dedent("""
    import json, sys
    import ddplab
    ssh, bare = json.loads(sys.argv[1]), sys.argv[2]
    remote = []
    lab = ddplab.start(world_size=2, backend="gloo", timeout=30, **ssh)
    remote += [lab.engines.rank_directory(r) for r in range(2)]
    lab.restart()
    remote += [lab.engines.rank_directory(r) for r in range(2)]
    lab.stop()
    for args in (ssh, {"engines": "slurm"}):
        try:
            ddplab.start(world_size=2, backend="gloo", timeout=30, remote_python=bare, **args)
        except ddplab.DdplabError:
            pass
    print(json.dumps(remote), flush=True)
""")


def test_an_exiting_kernel_leaves_nothing_after_stop_restart_and_failed_starts(ssh_hosts, slurm,
                                                                               tmp_path):
    """ipyparallel once re-created the lab's directory at exit, its key in a 0644 file: after an
    SSH lab's restart and stop, and failed SSH and Slurm starts, the kernel exits."""
    here = tmp_path / "tmp"
    here.mkdir()
    env = dict(os.environ, TMPDIR=str(here), DDPLAB_LOG_DIR=str(tmp_path / "logs"))
    ssh = {"hosts": ssh_hosts.aliases[:1], "ssh_cmd": ssh_hosts.ssh_cmd}
    out = subprocess.run([sys.executable, "-c", EXITING, json.dumps(ssh), BARE_PYTHON], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    remote = json.loads(out.stdout.strip().splitlines()[-1])
    assert os.listdir(here) == [], "left in the kernel's TMPDIR"
    assert [d for d in remote if os.path.exists(d)] == []
    assert [d for d in {os.path.dirname(d) for d in remote} if os.path.exists(d)] == []
    assert sorted(os.listdir(tmp_path)) == ["logs", "tmp"]          # no batch file here
    assert len(os.listdir(tmp_path / "logs")) == 2                  # one per failed start
    assert slurm.squeue() == []
