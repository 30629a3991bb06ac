"""Every documented multi-host path against a real daemon (the ``realhosts`` tier).

- SSH: ``start(hosts=["node-a", "node-b"], ssh_cmd=["ssh", "-F", cfg])``: two sshds
  in network namespaces, named by ssh-config aliases only (tests/realhosts.py).
- Slurm: ``start(engines="slurm")`` on a one-node Slurm 22.05 started here.
- MPI: ``start(engines="mpi")`` through Debian's Open MPI (as root: ``--allow-run-as-root``,
  which ddplab asks for by name).

Per path, one lab (a class-scoped fixture): start, ``lab.run`` against torch,
``%%ranks``, a deadlock as ``HangError``, ``restart``, a lost host or job as
``EngineDiedError`` naming the host, ``stop``, and that nothing is left: no
process, no Slurm job, no lab directory here or on the hosts, no batch file in
the working directory. Then starts that cannot work fail within 10 s with the
cause, and a killed kernel leaves nothing behind.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import ddplab
from ddplab import procs

pytestmark = pytest.mark.realhosts

MPI_ROOT = {"MPIEngineSetLauncher": {"mpi_args": ["--allow-run-as-root"]}}
#: A Python without ddplab (nor mpi4py): Debian's own.
BARE_PYTHON = "/usr/bin/python3"


def _rank_dirs(lab) -> list[str]:
    """Each rank's private directory on its host."""
    return [lab.engines.rank_directory(r) for r in range(lab.world_size)]


def _all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.arange(4.0) + 10 * dist.get_rank()
    dist.all_reduce(t)
    return t


def _deadlock():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)     # rank 1 never sends


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(what, seconds: float) -> list:
    """Wait until ``what()`` is empty; what is left then."""
    deadline = time.monotonic() + seconds
    left = what()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = what()
    return left


@pytest.fixture(scope="class")
def workdir(tmp_path_factory):
    """An empty working directory for the class (a batch file left there would show), and a
    private folder for kept logs."""
    cwd, here = os.getcwd(), tmp_path_factory.mktemp("cwd")
    logs = tmp_path_factory.mktemp("logs")
    old = os.environ.get("DDPLAB_LOG_DIR")
    os.environ["DDPLAB_LOG_DIR"] = str(logs)
    os.chdir(here)
    yield here
    os.chdir(cwd)
    if old is None:
        os.environ.pop("DDPLAB_LOG_DIR", None)
    else:
        os.environ["DDPLAB_LOG_DIR"] = old
    assert os.listdir(here) == [], "files left in the working directory"
    assert os.listdir(logs) == [], "a log kept though every start succeeded"


class Path:
    """The tests every path passes; a subclass gives ``lab`` and ``lose``."""

    world_size = 4

    def hosts(self, setup) -> list[str]:
        return ["127.0.0.1"]

    def test_start_and_all_reduce_match_torch(self, lab, setup):
        import torch
        assert [h["address"] for h in lab.hosts] == self.hosts(setup)
        expected = sum(torch.arange(4.0) + 10 * r for r in range(lab.world_size))
        for got in lab.run(_all_reduce):
            assert torch.equal(got, expected)
        # What ddplab wrote here, and on the hosts, only we can read.
        for d in [lab.directory, *self.remote_dirs(lab)]:
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        for d in self.remote_dirs(lab):
            for key_file in glob.glob(f"{d}/security/*.json"):
                assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600, key_file

    def test_ranks_magic(self, lab, shell, capsys):
        result = shell.run_cell("%%ranks\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\n"
                                "print(rank, world_size, x.item())")
        assert result.error_in_exec is None and result.error_before_exec is None
        n = lab.world_size
        total = n * (n + 1) / 2
        assert capsys.readouterr().out == "".join(f"[rank {r}]\n{r} {n} {total}\n" for r in range(n))

    def test_deadlock_is_a_hang_error_and_restart_recovers(self, lab):
        with pytest.raises(ddplab.HangError) as info:
            lab.run(_deadlock, timeout=3)
        assert "rank 0" in str(info.value), info.value
        start = time.monotonic()
        lab.restart()
        print(f"\nrestart: {time.monotonic() - start:.1f} s")
        assert len(lab.run(_all_reduce)) == lab.world_size

    def test_a_lost_host_is_named(self, lab, setup):
        lost_dirs = _rank_dirs(lab)
        self.lose(lab, setup)
        start = time.monotonic()
        with pytest.raises(ddplab.EngineDiedError) as info:
            lab.run(_all_reduce, timeout=30)
        took = time.monotonic() - start
        host = lab.hosts[-1]
        assert f"lost host {host['address']}" in str(info.value), info.value
        assert set(info.value.ranks) <= set(range(lab.world_size)) and info.value.ranks
        print(f"\nlost host reported after {took:.1f} s")
        lab.restart()
        assert len(lab.run(_all_reduce)) == lab.world_size
        # What the killed ranks could not remove went with their host's or lab's directory.
        assert [d for d in lost_dirs if os.path.exists(d)] == []

    def stop_leaves_nothing(self, lab, setup) -> None:
        """Each path's last test (its own ``test_stop_leaves_nothing``, defined last)."""
        lab_dir, remote, rank_dirs = lab.directory, self.remote_dirs(lab), _rank_dirs(lab)
        pids = list(lab.pids)
        lab.stop()
        assert _gone_within(lambda: [p for p in pids if _alive(p)], 10) == []
        # No process this test process started (ssh clients, mpiexec, the controller) is left
        # beyond those that ran before the lab started.
        new = _gone_within(lambda: [p.pid for p in psutil.Process().children(recursive=True)
                                    if p.pid not in type(self).before and _alive(p.pid)], 10)
        assert not new, [psutil.Process(p).cmdline() for p in new if _alive(p)]
        assert not os.path.exists(lab_dir)
        assert [d for d in remote + rank_dirs if os.path.exists(d)] == []
        self.nothing_left(setup)
        import gc
        gc.collect()                      # ipyparallel's objects go: nothing re-creates the dir
        time.sleep(0.5)
        assert not os.path.exists(lab_dir)

    # per path
    def remote_dirs(self, lab) -> list[str]:
        return []

    def nothing_left(self, setup) -> None:
        pass


@pytest.fixture(scope="class")
def setup(request):
    """The daemons of the class's path."""
    return request.cls.daemons(request)


@pytest.fixture(scope="class")
def lab(request, setup, workdir):
    """The class's lab, started with only what docs/multi-host.md says to pass."""
    request.cls.before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    lab = ddplab.start(world_size=request.cls.world_size, backend="gloo", timeout=30,
                       **request.cls.args(setup))
    print(f"\n{request.cls.__name__}: {lab.world_size} ranks ready in "
          f"{time.monotonic() - start:.1f} s")
    yield lab
    lab.stop()


class TestSSH(Path):
    @staticmethod
    def daemons(request):
        return request.getfixturevalue("ssh_hosts")

    @staticmethod
    def args(setup):
        return {"hosts": setup.aliases, "ssh_cmd": setup.ssh_cmd}

    def hosts(self, setup):
        return setup.addresses

    def remote_dirs(self, lab):
        # The agent's directory on each host holds its engines' TMPDIR.
        return sorted({os.path.dirname(d) for d in _rank_dirs(lab)})

    def lose(self, lab, setup):
        # The second host's engines are killed (as if the host went down).
        for rank in lab.hosts[-1]["ranks"]:
            procs.send(lab.pids[rank], signal.SIGKILL)

    def test_a_dropped_ssh_session_ends_that_hosts_engines(self, lab, setup):
        """The host's sshd loses our session (its session processes killed): the agent there
        sees its input end, ends its engines and removes its directory; the lab names the host."""
        host = lab.hosts[-1]
        dirs = sorted({os.path.dirname(lab.engines.rank_directory(r)) for r in host["ranks"]})
        pids = [lab.pids[r] for r in host["ranks"]]
        sshd = psutil.Process(setup.sshd[-1].pid)
        for session in sshd.children():
            procs.send(session, signal.SIGKILL)
        with pytest.raises(ddplab.EngineDiedError, match=f"lost host {host['address']}"):
            lab.run(_all_reduce, timeout=30)
        assert _gone_within(lambda: [p for p in pids if _alive(p)], 10) == []
        assert _gone_within(lambda: [d for d in dirs if os.path.exists(d)], 10) == []
        lab.restart()
        assert len(lab.run(_all_reduce)) == lab.world_size

    def nothing_left(self, setup):
        # No process left under either host's sshd (its sessions, the agents, the engines).
        def under_sshd():
            return [p.pid for s in setup.sshd for p in psutil.Process(s.pid).children(recursive=True)
                    if _alive(p.pid)]
        assert _gone_within(under_sshd, 10) == []

    def test_stop_leaves_nothing(self, lab, setup, workdir):
        self.stop_leaves_nothing(lab, setup)


class TestSlurm(Path):
    world_size = 2

    @staticmethod
    def daemons(request):
        return request.getfixturevalue("slurm")

    @staticmethod
    def args(setup):
        return {"engines": "slurm"}

    def lose(self, lab, setup):
        for line in setup.squeue():
            subprocess.run(["scancel", line.split()[0]], check=True)
        # Slurm ends the job's processes a moment later (what the next call then meets).
        assert _gone_within(lambda: [p for p in lab.pids if _alive(p)], 20) == []

    def nothing_left(self, setup):
        assert _gone_within(setup.squeue, 10) == []

    def test_stop_leaves_nothing(self, lab, setup, workdir):
        self.stop_leaves_nothing(lab, setup)


class TestMPI(Path):
    world_size = 2

    @staticmethod
    def daemons(request):
        from realhosts import need_root
        need_root("mpiexec")

    @staticmethod
    def args(setup):
        return {"engines": "mpi", "config": MPI_ROOT}

    def lose(self, lab, setup):
        procs.send(lab.pids[-1], signal.SIGKILL)             # mpiexec then ends the others

    def test_stop_leaves_nothing(self, lab, setup, workdir):
        self.stop_leaves_nothing(lab, setup)


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


# ----------------------------------------------------------- attach
def test_attach_to_a_slurm_cluster_you_started_leaves_it_running(slurm, tmp_path):
    """``ipcluster start --engines=slurm`` as docs/multi-host.md shows, then ``ddplab.attach``."""
    import ipyparallel as ipp
    profile = str(tmp_path / "profile")
    ipcluster = subprocess.Popen(
        [sys.executable, "-m", "ipyparallel.cluster", "start", "--engines=slurm", "--n=2",
         f"--profile-dir={profile}", "--cluster-id=mine", "--ip=127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # As a user would: once ipcluster is up (its connection file written), attach.
        ready = _gone_within(lambda: [] if os.path.exists(
            f"{profile}/security/ipcontroller-mine-client.json") else ["not yet"], 60)
        assert not ready, "ipcluster wrote no connection file in 60 s"
        lab = ddplab.attach(profile_dir=profile, cluster_id="mine", world_size=2, backend="gloo",
                            timeout=60)
        try:
            assert len(lab.run(_all_reduce)) == 2
        finally:
            lab.stop()
        assert len(slurm.squeue()) == 1, "attach stopped a job it did not start"
        client = ipp.Client(profile_dir=profile, cluster_id="mine")
        assert len(client.ids) == 2                    # your engines stay yours
        client.close()
    finally:
        procs.send(ipcluster, signal.SIGINT)          # Ctrl-C: ipcluster stops its cluster
        try:
            ipcluster.wait(30)
        finally:
            procs.end_tree(ipcluster, grace=5)
            ipcluster.wait(10)
    assert _gone_within(slurm.squeue, 20) == []
