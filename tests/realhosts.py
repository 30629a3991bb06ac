"""Real daemons for the ``realhosts`` tier (a pytest plugin, imported by conftest.py).

- ``ssh_hosts``: two SSH hosts. Each is a network namespace on a private bridge
  (a fresh 10.213.x.0/24, names unique per run) with its own key-only sshd
  (Debian's ``/usr/sbin/sshd -D``, a child of this process), and an ssh config
  whose aliases (``node-a``, ``node-b``) resolve nowhere but in it.
- ``slurm``: a one-node Slurm: munged, slurmctld and slurmd in the foreground
  (children of this process), a generated slurm.conf on free ports under a
  temporary folder, ``SLURM_CONF`` set for the session.

Every daemon is ended by its pid and the namespaces are deleted at teardown.
They need root (namespaces, sshd, slurmd): without root the tests skip and say
so; as root, a missing daemon is a failure that names ``tools/ensure_hosts.sh``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import pytest

from ddplab import procs

__all__ = ["ssh_hosts", "slurm", "SSHHosts", "Slurm", "need_root", "ssh_network"]

#: How ``start(engines="mpi")`` runs as root: Open MPI refuses root unless asked by name.
MPI_ROOT = {"MPIEngineSetLauncher": {"mpi_args": ["--allow-run-as-root"]}}

_DAEMONS = {"/usr/sbin/sshd": "openssh-server", "/usr/sbin/slurmctld": "slurm-wlm",
            "/usr/sbin/slurmd": "slurm-wlm", "/usr/sbin/munged": "munge"}


def need_root(*paths: str) -> None:
    """Skip without root; fail, naming the fix, when a daemon is missing."""
    if os.geteuid() != 0:
        pytest.skip("the realhosts tier starts sshd, Slurm and network namespaces: it needs root "
                    "(CI runs it as root)")
    missing = sorted({_DAEMONS.get(p, p) for p in paths
                      if not (os.path.exists(p) or shutil.which(p))})
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run `bash tools/ensure_hosts.sh` as root "
                    f"(make test does)", pytrace=False)


def gone_within(what, seconds: float) -> list:
    """Wait until ``what()`` is empty; what is left then."""
    deadline = time.monotonic() + seconds
    left = what()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = what()
    return left


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _end(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End one daemon we started (and what it forked), by its pid; reap it."""
    procs.end_tree(proc, grace=grace)
    proc.wait(5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SSHHosts:
    work: str
    aliases: list[str]
    addresses: list[str]
    namespaces: list[str]
    root_ip: str
    ssh_cmd: list[str]
    sshd: list[subprocess.Popen] = field(default_factory=list)


def _subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    taken = [ipaddress.ip_interface(w) for w in used.split() if w.count(".") == 3 and "/" in w]
    while True:
        # 10.213.0/24 is tools/realhosts.sh's default; stay clear of it.
        net = ipaddress.ip_network(f"10.213.{random.randint(100, 250)}.0/24")
        if not any(t.ip in net for t in taken):
            return net


@contextlib.contextmanager
def ssh_network():
    """Two sshd hosts in namespaces on a private bridge (see the module docstring), removed after."""
    tag = "rh" + secrets.token_hex(3)
    net = _subnet()
    switch, names = f"{tag}-sw", [f"{tag}-h{i}" for i in (1, 2)]
    hosts = SSHHosts(work=tempfile.mkdtemp(prefix="realhosts-ssh-"), aliases=["node-a", "node-b"],
                     addresses=[str(net[11]), str(net[12])], namespaces=names, root_ip=str(net[1]),
                     ssh_cmd=[])
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip("link", "add", tag, "type", "veth", "peer", "name", "up0", "netns", switch)
        _ip("-n", switch, "link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{hosts.root_ip}/24", "dev", tag)
        _ip("link", "set", tag, "up")
        for i, (name, addr) in enumerate(zip(names, hosts.addresses)):
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "add", "eth1", "netns", name, "type", "veth", "peer", "name", f"p{i}",
                "netns", switch)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth1")
            _ip("-n", name, "link", "set", "eth1", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        w = hosts.work
        key = f"{w}/id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        shutil.copy(f"{key}.pub", f"{w}/authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)            # sshd's privilege-separation dir
        config = []
        for alias, name, addr in zip(hosts.aliases, names, hosts.addresses):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{w}/host_{alias}"],
                           check=True)
            with open(f"{w}/sshd_{alias}.conf", "w") as f:
                f.write(f"ListenAddress {addr}\nPort 22\nHostKey {w}/host_{alias}\n"
                        f"PidFile none\nPermitRootLogin prohibit-password\n"
                        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                        f"StrictModes no\nAuthorizedKeysFile {w}/authorized_keys\n"
                        f"MaxStartups 100:30:200\nMaxSessions 50\n")
            # -D: in the foreground, so the pid we hold is sshd's own.
            hosts.sshd.append(subprocess.Popen(
                ["ip", "netns", "exec", name, "/usr/sbin/sshd", "-D", "-f", f"{w}/sshd_{alias}.conf",
                 "-E", f"{w}/sshd_{alias}.log"], stdin=subprocess.DEVNULL))
            config.append(f"Host {alias}\n    HostName {addr}\n    User root\n"
                          f"    IdentityFile {key}\n    IdentitiesOnly yes\n    BatchMode yes\n"
                          f"    StrictHostKeyChecking no\n    UserKnownHostsFile {w}/known_hosts\n"
                          f"    LogLevel ERROR\n    ConnectTimeout 10\n")
        with open(f"{w}/config", "w") as f:
            f.write("\n".join(config))
        hosts.ssh_cmd = ["ssh", "-F", f"{w}/config"]
        deadline = time.monotonic() + 20
        for alias in hosts.aliases:
            while subprocess.run([*hosts.ssh_cmd, alias, "true"], capture_output=True).returncode:
                assert time.monotonic() < deadline, f"sshd on {alias} did not answer in 20 s"
                time.sleep(0.2)
        yield hosts
    finally:
        for proc in hosts.sshd:
            _end(proc)
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", tag], capture_output=True)
        left = [n for n in made if n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout]
        shutil.rmtree(hosts.work, ignore_errors=True)
        assert not left, f"could not delete namespaces {left}"


# Module scope: the daemons (slurmctld and slurmd listen on every interface of this
# machine) end with each tests/test_realhosts_*.py module, before tests that check what listens.
@pytest.fixture(scope="module")
def ssh_hosts():
    need_root("/usr/sbin/sshd", "ssh", "ssh-keygen", "ip")
    with ssh_network() as hosts:
        yield hosts


@dataclass
class Slurm:
    work: str
    conf: str
    daemons: list[subprocess.Popen]

    def squeue(self) -> list[str]:
        """Every job Slurm still has pending or running: ``id state`` lines."""
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True)
        return out.stdout.split("\n")[:-1]


@pytest.fixture(scope="module")
def slurm():
    need_root("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "sbatch")
    w = tempfile.mkdtemp(prefix="realhosts-slurm-")
    daemons: list[subprocess.Popen] = []
    old = os.environ.get("SLURM_CONF")
    try:
        for d in ("spool", "ctld", "munge"):
            os.makedirs(f"{w}/{d}", mode=0o700)
        with open(f"{w}/munge/munge.key", "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(f"{w}/munge/munge.key", 0o400)
        sock = f"{w}/munge/munge.socket"
        daemons.append(subprocess.Popen(
            ["/usr/sbin/munged", "-F", "--force", f"--key-file={w}/munge/munge.key",
             f"--socket={sock}", f"--pid-file={w}/munge/munged.pid",
             f"--log-file={w}/munge/munged.log", f"--seed-file={w}/munge/seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        conf = f"{w}/slurm.conf"
        with open(conf, "w") as f:
            f.write(f"""ClusterName=realhosts
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd.pid
SlurmdSpoolDir={w}/spool
StateSaveLocation={w}/ctld
SlurmctldLogFile={w}/slurmctld.log
SlurmdLogFile={w}/slurmd.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
NodeName=localhost CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")
        os.environ["SLURM_CONF"] = conf
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert time.monotonic() < deadline, "munged did not start in 20 s"
            time.sleep(0.1)
        # Their logs are in w (SlurmctldLogFile, SlurmdLogFile), not on the test's output.
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(subprocess.Popen([f"/usr/sbin/{daemon}", "-D", "-f", conf],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        cluster = Slurm(w, conf, daemons)
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True,
                                           text=True).stdout:
            assert time.monotonic() < deadline, f"Slurm's node is not idle in 20 s ({w}/*.log)"
            time.sleep(0.2)
        yield cluster
    finally:
        if daemons:
            subprocess.run(["scancel", "--user=root"], capture_output=True)
        for proc in reversed(daemons):          # slurmd, slurmctld, then munged
            _end(proc, grace=10)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        shutil.rmtree(w, ignore_errors=True)
