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
the working directory. Then ``ddplab.attach`` to a Slurm cluster the user started.
Starts that cannot work, and a kernel that dies or exits: tests/test_realhosts_failures.py.
"""

from __future__ import annotations

import glob
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest
from conftest import alive as _alive
from realhosts import MPI_ROOT, gone_within as _gone_within

import ddplab
from ddplab import procs

pytestmark = pytest.mark.realhosts


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
