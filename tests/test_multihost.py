"""A lab across hosts, for real: hosts are network namespaces joined by veth pairs.

Topology (one private /24 picked at random per run, names unique per run)::

    root namespace (this test, the kernel side)      ipcontroller on .1
        veth ── bridge in namespace "<tag>-sw" ── veth ── namespace "<tag>-h0": .11, engines of ranks 0, 1
                                               └── veth ── namespace "<tag>-h1": .12, engines of ranks 2, 3

The controller listens on .1 only; the engines run inside the host namespaces
(``ip netns exec`` around ipyparallel's engine command) and ``ddplab.attach``
forms a 4-rank gloo group over them. Everything is removed in a ``finally``.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

import ddplab
from ddplab import procs
from ddplab.hosts import Engine, place, rank_env, rank_table
from ddplab.lab.multihost import host_ranks as multihost, start as hoststart
from ddplab.lab.ranks import heartbeat_args

PER_HOST = 2
HOSTS = 2


# ----------------------------------------------------------- pure placement
def test_rank_table_is_torchruns_numbering():
    table = [(p.node_rank, p.local_rank, p.rank) for p in rank_table(2, 4)]
    assert table == [(n, local, n * 4 + local) for n in range(2) for local in range(4)]


def test_place_orders_by_host_then_engine_and_env_is_per_host():
    engines = [Engine(i, a, "same-name", "eth1", 100 + i, 0, "/tmp")
               for i, a in enumerate(["10.0.0.12", "10.0.0.11", "10.0.0.12", "10.0.0.9"])]
    placed = place(engines)
    assert [(p.host, p.engine_id, p.local_rank, p.local_world_size) for p in placed] == [
        ("10.0.0.9", 3, 0, 1), ("10.0.0.11", 1, 0, 1),
        ("10.0.0.12", 0, 0, 2), ("10.0.0.12", 2, 1, 2)]
    # The user's host order wins over address order.
    assert [p.host for p in place(engines, ["10.0.0.12"])][:2] == ["10.0.0.12", "10.0.0.12"]
    env = rank_env(placed[3], "10.0.0.9", 1234, "eth1")
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"],
            env["MASTER_ADDR"], env["GLOO_SOCKET_IFNAME"]) == ("3", "1", "2", "2", "10.0.0.9", "eth1")


def test_both_kinds_of_ranks_provide_the_whole_ranks_interface():
    """Lab is composed from a Ranks; each implementation has every member the lab may use."""
    from ddplab.lab.local import LocalRanks
    from ddplab.lab.ranks import Ranks
    wanted = {name for name in vars(Ranks) if not name.startswith("_")} | set(Ranks.__annotations__)
    spec = ddplab.lab.LabSpec.build(2, "gloo")
    for ranks in (LocalRanks(spec, 0), multihost.HostRanks(spec, connect=lambda: None)):
        missing = {name for name in wanted if not hasattr(ranks, name)}
        assert not missing, f"{type(ranks).__name__} lacks {sorted(missing)}"


def test_hosts_must_split_world_size():
    with pytest.raises(ddplab.ConfigError, match="does not split evenly over 3 hosts"):
        hoststart.split_hosts(["a", "b", "c"], 4)
    with pytest.raises(ddplab.ConfigError, match="hosts takes a list"):
        hoststart.split_hosts("a", 4)
    assert hoststart.split_hosts({"a": 3, "b": 1}, 4) == {"a": 3, "b": 1}


def test_security_args_keep_signing_with_curve():
    args = hoststart.security_args()
    assert "--IPController.enable_curve=True" in args
    key = [a for a in args if a.startswith("--Session.key=")][0].split("=", 1)[1]
    assert len(key) == 64


# ----------------------------------------------------------- the network
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """Namespaces ``<tag>-sw`` (a bridge), ``<tag>-h0..`` (hosts) and one veth in the root namespace."""

    def __init__(self, hosts: int) -> None:
        self.tag = "ddpl" + secrets.token_hex(3)
        used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        while True:
            net = ipaddress.ip_network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
            if not any(ipaddress.ip_address(w.split("/")[0]) in net
                       for w in used.split() if w.count(".") == 3 and "/" in w):
                break
        self.net = net
        self.root_ip = str(net[1])
        self.host_ips = [str(net[11 + i]) for i in range(hosts)]
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.root_link = self.tag           # 10 characters: within IFNAMSIZ

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", "up0",
            "netns", self.switch)
        _ip("-n", self.switch, "link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{self.root_ip}/24", "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        for i, (name, address) in enumerate(zip(self.names, self.host_ips)):
            _ip("netns", "add", name)
            _ip("link", "add", "eth1", "netns", name, "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth1")
            _ip("-n", name, "link", "set", "eth1", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def down(self) -> list[str]:
        """Delete what up() made (and only that); return what could not be deleted."""
        problems = []
        for name in self.names + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        # Deleting the switch namespace deleted our veth's peer, and so the veth.
        subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        problems += [n for n in self.names + [self.switch] if n in listed]
        links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
        problems += [self.root_link] if f" {self.root_link}@" in links or \
            f" {self.root_link}:" in links else []
        return problems


def _why_no_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 is missing (no `ip` command): apt-get install iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs this test as root)"
    return None


def _spawn(cmd: list[str], log: str, netns: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, DDPLAB_PARENT_PID=str(os.getpid()))
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
        env.update(DDPLAB_PRELOAD="torch", OMP_NUM_THREADS="1")
    # `ip netns exec` execs the command, so the pid is the engine's own.
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def hosts_lab():
    reason = _why_no_namespaces()
    if reason:
        pytest.skip(reason)
    network = Network(HOSTS)
    work = tempfile.mkdtemp(prefix="ddplab-netns-")
    processes: list[subprocess.Popen] = []
    lab = None
    try:
        try:
            network.up()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
        tether = [sys.executable, "-m", "ddplab.rank.tether"]
        common = [f"--profile-dir={work}", "--cluster-id=netns"]
        processes.append(_spawn(tether + ["ipyparallel.controller", f"--ip={network.root_ip}",
                                         *heartbeat_args(),
                                         *hoststart.security_args(), *common],
                                f"{work}/controller.log"))
        engines: dict[str, list[subprocess.Popen]] = {}
        spawned = 0

        def spawn_engines(name: str) -> None:
            """Start (or start again) a host's engines."""
            nonlocal spawned
            engines[name] = [_spawn(tether + ["ipyparallel.engine", "--IPEngine.enable_nanny=False",
                                             "--IPEngine.wait_for_url_file=120", *common],
                                    f"{work}/{name}-{spawned + i}.log", netns=name)
                             for i in range(PER_HOST)]
            spawned += PER_HOST
            processes.extend(engines[name])

        for name in network.names:
            spawn_engines(name)
        lab = ddplab.attach(f"{work}/security/ipcontroller-netns-client.json",
                            world_size=HOSTS * PER_HOST, backend="gloo", timeout=60)
        yield lab, network, engines, {"dir": work, "controller": processes[0].pid,
                                      "spawn_engines": spawn_engines}
    finally:
        if lab is not None:
            lab.stop()
        # The controller forks its schedulers, so each process's whole tree is ended.
        procs.end_tree(*processes, grace=0)
        for p in processes:
            p.wait(10)
        problems = network.down()
        shutil.rmtree(work, ignore_errors=True)
        assert not problems, f"could not remove {problems}"


def _whoami():
    import os
    return {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                       "MASTER_ADDR", "GLOO_SOCKET_IFNAME")}


def test_ranks_are_ordered_by_host_and_env_is_per_host(hosts_lab):
    lab, network, _, _ = hosts_lab
    a, b = network.host_ips
    assert lab.hosts == [{"node_rank": 0, "address": a, "hostname": lab.hosts[0]["hostname"],
                          "ranks": [0, 1]},
                         {"node_rank": 1, "address": b, "hostname": lab.hosts[1]["hostname"],
                          "ranks": [2, 3]}]
    assert lab.run(_whoami) == [
        {"RANK": str(r), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2",
         "GROUP_RANK": str(r // 2), "MASTER_ADDR": a, "GLOO_SOCKET_IFNAME": "eth1"}
        for r in range(4)]


def _all_reduce_rank_tensors():
    import torch
    import torch.distributed as dist
    t = torch.arange(4.0) + 10 * dist.get_rank()
    dist.all_reduce(t)
    return t


def _default_store_kind():
    from torch.distributed import distributed_c10d
    return type(distributed_c10d._get_default_store().underlying_store).__name__


def test_a_multihost_lab_still_meets_at_a_tcpstore(hosts_lab):
    # A local lab meets in an owner-only FileStore; a file cannot span hosts.
    assert hosts_lab[0].run(_default_store_kind) == ["TCPStore"] * 4


def test_an_attached_lab_restarts_on_the_same_engines(hosts_lab):
    # A second group on the same engines: rank 0's new store must not lose its socket
    # when the first store's is closed (engine.open_store hands the descriptor over).
    lab = hosts_lab[0]
    lab.restart()
    assert [who["RANK"] for who in lab.run(_whoami)] == ["0", "1", "2", "3"]


def test_lost_host_is_named_within_the_timeout(hosts_lab):
    """It kills host 1's engines, and the lab reports that host and its ranks; then it
    starts that host's engines again and restarts the lab, for the tests after it."""
    lab, network, engines, setup = hosts_lab
    timeout = 30
    # What a killed engine cannot remove itself. A real lost host keeps these; here
    # the "hosts" share this machine's /tmp, so the test removes them afterwards.
    lost_dirs = [lab.engines.rank_directory(rank) for rank in (2, 3)]
    try:
        for p in engines[network.names[1]]:
            procs.send(p, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ddplab.EngineDiedError) as info:
            lab.run(_all_reduce_rank_tensors, timeout=timeout)
        took = time.monotonic() - start
        message = str(info.value)
        assert network.host_ips[1] in message and "node 1" in message and "2, 3" in message, message
        assert info.value.ranks == [2, 3]
        assert took < timeout, f"reported after {took:.1f} s"
        # And it stays reported, without waiting, on the next call.
        with pytest.raises(ddplab.DdplabError, match=f"lost host {network.host_ips[1]}.*lab.restart"):
            lab.run(_whoami)
        print(f"\nlost host reported after {took:.1f} s")
    finally:
        for path in lost_dirs:
            shutil.rmtree(path, ignore_errors=True)
        setup["spawn_engines"](network.names[1])
        lab.restart()
    placed = [p.host for p in lab.engines.placements]
    assert placed == [ip for ip in network.host_ips for _ in range(PER_HOST)]
    assert [who["RANK"] for who in lab.run(_whoami)] == ["0", "1", "2", "3"]


def test_all_reduce_across_hosts_matches_torch(hosts_lab):
    import torch
    lab = hosts_lab[0]
    expected = sum(torch.arange(4.0) + 10 * r for r in range(4))
    for got in lab.run(_all_reduce_rank_tensors):
        assert torch.equal(got, expected)


def _ddp_steps(steps: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)     # this rank's quarter of the batch
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return [p.detach() for p in model.module.parameters()]


def test_short_ddp_training_matches_one_process(hosts_lab):
    import torch
    lab = hosts_lab[0]
    got = lab.run(_ddp_steps, 3)
    # The reference: one process, the whole batch (DDP averages the ranks' gradients,
    # and equal shards make that the whole batch's mean-loss gradient).
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for params in got:
        for p, q in zip(params, model.parameters()):
            assert torch.allclose(p, q.detach(), atol=1e-6)


def _my_sockets():
    return [(c.status, c.laddr.ip.removeprefix("::ffff:"),
             c.raddr.ip.removeprefix("::ffff:") if c.raddr else None)
            for c in psutil.Process().net_connections(kind="inet")]


def test_traffic_stays_on_the_namespaces_addresses(hosts_lab):
    """Every socket of every rank, and of the controller, is on the test network's own addresses.

    127.0.0.1 inside a namespace is that namespace's own loopback (a process's
    internal socket pair), which cannot reach anything outside it.
    """
    lab, network, _, _ = hosts_lab
    lab.run(_all_reduce_rank_tensors)                 # gloo's pairs are open now
    ours = {network.root_ip, *network.host_ips}
    for rank, sockets in enumerate(lab.run(_my_sockets)):
        host = lab.hosts[rank // PER_HOST]["address"]
        for status, local, remote in sockets:
            assert local in (host, "127.0.0.1"), (rank, status, local, remote)
            assert remote is None or remote in ours | {"127.0.0.1"}, (rank, status, local, remote)
            assert remote != "127.0.0.1" or local == "127.0.0.1", (rank, status, local, remote)
        assert any(remote in ours - {host} for _, _, remote in sockets), "no cross-host traffic?"
    controller = psutil.Process(hosts_lab[3]["controller"])
    for proc in [controller, *controller.children(recursive=True)]:
        for c in proc.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                assert c.laddr.ip in (network.root_ip, "127.0.0.1"), c


def test_curve_on_and_signing_kept(hosts_lab):
    """The connection file the ranks and the kernel used: CurveZMQ key and HMAC key both set."""
    import json
    info = json.load(open(f"{hosts_lab[3]['dir']}/security/ipcontroller-netns-client.json"))
    assert info["curve_serverkey"] and info["key"] and info["signature_scheme"].startswith("hmac")


def _timed_all_reduce(nbytes: int, repeats: int):
    import time

    import torch
    import torch.distributed as dist
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)                                 # warm up the pairs
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(t)
    seconds = (time.perf_counter() - start) / repeats
    return seconds, t[0].item()


def test_all_reduce_figures(hosts_lab, capsys):
    lab = hosts_lab[0]
    n = lab.world_size
    with capsys.disabled():
        for nbytes in (1 << 20, 16 << 20):
            timed = lab.run(_timed_all_reduce, nbytes, 5)
            # Six sums of ones over n ranks: n ** 6 everywhere, or the figure measured nothing.
            assert [value for _, value in timed] == [float(n ** 6)] * n
            seconds = max(s for s, _ in timed)
            busbw = nbytes / seconds * 2 * (n - 1) / n / 1e9
            print(f"\ncross-host all_reduce {nbytes >> 20} MB, {n} ranks on {HOSTS} hosts: "
                  f"{seconds * 1e3:.1f} ms, busbw {busbw:.2f} GB/s")
    assert seconds > 0


# ----------------------------------------------------------- launcher configuration
@pytest.mark.parametrize("engines, section", [("ssh", "SSHEngineSetLauncher"),
                                              ("mpi", "MPIEngineSetLauncher"),
                                              ("slurm", "SlurmEngineSetLauncher")])
def test_launchers_are_ipyparallels_own(engines, section, tmp_path):
    from ddplab.lab import LabSpec
    spec = LabSpec(world_size=4, backend="gloo", timeout=60, grace=2, pg_timeout=1800, debug=False)
    counts = {"node1": 2, "user@node2:2222": 2} if engines == "ssh" else None
    launch = hoststart.HostEngines(engines=engines, counts=counts, listen="10.1.2.3",
                               location="10.1.2.3", ssh_cmd=None, remote_python="python3",
                               config={section: {"mpi_args": ["-x"]}})
    cluster = launch.configure(str(tmp_path), spec)
    assert type(cluster).__name__ == "Cluster"
    assert cluster.engine_launcher_class.__name__ == section
    assert cluster.controller_ip == "10.1.2.3"
    assert "--IPController.enable_curve=True" in cluster.controller_args
    assert cluster.config[section].engine_cmd[-2:] == ["ddplab.rank.tether", "ipyparallel.engine"]
    assert cluster.config[section].mpi_args == ["-x"]
    if engines == "ssh":
        assert cluster.config.SSHEngineSetLauncher.engines == counts


def test_start_with_hosts_checks_before_starting():
    with pytest.raises(ddplab.ConfigError, match="not a launcher ddplab uses"):
        ddplab.start(world_size=2, engines="kubernetes")
    with pytest.raises(ddplab.ConfigError, match="does not split evenly"):
        ddplab.start(world_size=3, hosts=["a", "b"])
