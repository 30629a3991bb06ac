"""A lab no other user of the machine can reach: tried for real, as the user ``nobody``.

On a class server every student's lab runs beside the others'. gloo does not
authenticate its peers and the ``*_object`` collectives unpickle what they
receive, so a port of a lab that another user can connect to is a way into
that student's ranks. Here the other user is ``nobody``: for each socket a
running lab listens on (every TCP port in the ranks' network, seen through
``/proc/PID/net/tcp``, and every Unix socket in its directory), a process of
``nobody`` tries to connect. None may succeed. The same attempt against a port
this test opens on the machine's own 127.0.0.1 must succeed, so a broken
attempt cannot pass for a private lab.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import textwrap

import pytest
from labprobe import connect_as, in_use_here, lab_sockets, runs_as

from ddplab.lab import Lab, LabSpec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user")]

NOBODY = pwd.getpwnam("nobody").pw_uid


# Connecting needs only the standard library: any interpreter nobody may run will do.
NOBODYS_PYTHON = next((p for p in (sys.executable, "/usr/bin/python3") if runs_as(p, NOBODY)), None)


def _connect_as_nobody(ports: list[int], paths: list[str], namespaces: list[str] = ()) -> list[str]:
    """What ``nobody`` could connect to or enter (``labprobe.connect_as``)."""
    assert NOBODYS_PYTHON, "no Python that nobody may run (neither this one nor /usr/bin/python3)"
    return connect_as(NOBODY, NOBODY, NOBODYS_PYTHON, ports, paths, namespaces)


def _all_reduce_one() -> int:
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t)


@pytest.mark.parametrize("init_method", ["store", "env"])
def test_no_socket_of_a_running_lab_accepts_another_users_connection(init_method):
    lab = Lab(LabSpec.build(2, "gloo", 60, init_method=init_method), gpus=0).start()
    try:
        # gloo's pair sockets exist once a collective ran; "env" adds rank 0's TCPStore.
        assert lab.run(_all_reduce_one) == [2, 2]
        ports, paths = lab_sockets(lab.controller_pid, lab.engines.pids)
        assert ports, "expected the ranks to listen (gloo) in their network"
        assert len(paths) >= 10, "expected the controller's Unix sockets"
        assert not lab.describe().count("share this machine's network")
        # A port number of the ranks' network may be in use on this machine's too
        # (by anything else running here): reaching that one says nothing of the lab.
        elsewhere = in_use_here()
        ports = [port for port in ports if port not in elsewhere]
        assert ports, "every port of the ranks is also in use on this machine's network"
        namespaces = [f"/proc/{pid}/ns/net" for pid in lab.engines.pids]
        assert _connect_as_nobody(ports, paths, namespaces) == []
    finally:
        lab.stop()


def test_the_attempt_does_reach_what_is_open():
    """The control: ``nobody``'s attempt connects to a port open on this machine's 127.0.0.1."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert _connect_as_nobody([port], []) == [f"tcp {port}"]


# A whole lab in a process of its own, with the environment and the user given.
LAB_IN_A_PROCESS = textwrap.dedent("""
    import json, os, ddplab, torch.distributed as dist
    with ddplab.start(world_size=2, backend="gloo", timeout=60) as lab:
        rank0 = lab.engines.pids[0]
        same = os.stat(f"/proc/{rank0}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
        total = lab.run(lambda: (lambda t: (dist.all_reduce(t), int(t))[1])(__import__("torch").ones(1)))
        owner = os.stat(lab.directory).st_uid
        print(json.dumps({"describe": lab.describe(), "same_network": same, "total": total,
                          "uid": os.getuid(), "owner": owner}))
""")


def _lab_in_a_process(env: dict[str, str], user: int | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", LAB_IN_A_PROCESS], env=dict(os.environ, **env),
                          user=user, group=user, extra_groups=[] if user is not None else None,
                          cwd="/", capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(NOBODYS_PYTHON != sys.executable,
                    reason=f"nobody may not run {sys.executable} (a Python in a private home); "
                           "test_the_user_namespace_path_works_as_root takes the same path as root")
def test_a_student_who_is_not_root_gets_a_private_network_too():
    """The path every student on a class server takes: a user namespace, then a network one."""
    seen = _lab_in_a_process({"HOME": "/tmp"}, user=NOBODY)
    assert seen["uid"] == NOBODY and seen["owner"] == NOBODY     # files stay the student's
    assert seen["same_network"] is False
    assert seen["total"] == [2, 2]
    assert "share this machine's network" not in seen["describe"]


def test_the_user_namespace_path_works_as_root():
    seen = _lab_in_a_process({"DDPLAB_NETNS": "user"})
    assert (seen["same_network"], seen["total"], seen["owner"]) == (False, [2, 2], 0)


def test_where_the_machine_forbids_it_start_says_what_is_exposed():
    seen = _lab_in_a_process({"DDPLAB_NETNS": "0"})
    assert seen["same_network"] is True and seen["total"] == [2, 2]
    lines = seen["describe"].splitlines()
    assert len(lines) == 2, seen["describe"]
    for words in ("share this machine's network", "DDPLAB_NETNS=0", "other users",
                  "gloo sockets on 127.0.0.1", "Unix sockets"):
        assert words in lines[1]


def test_a_tcpstore_in_the_ranks_network_says_nothing_of_names(capsys):
    """c10d names each store peer (getnameinfo); in a network without DNS that must not warn."""
    lab = Lab(LabSpec.build(2, "gloo", 60, init_method="env"), gpus=0).start()
    try:
        lab.run_cell("import datetime\n"
                     "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                     "c = dist.TCPStore('127.0.0.1', s.port, is_master=False,\n"
                     "                  timeout=datetime.timedelta(seconds=20))\n"
                     "c.set('k', 'v'); print(s.get('k'))\n")
        out = capsys.readouterr()
        assert out.out == "[rank 0]\nb'v'\n[rank 1]\nb'v'\n", out
        assert "hostname" not in out.err and "[c10d]" not in out.err, out.err
    finally:
        lab.stop()
