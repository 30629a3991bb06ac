"""Trying a running lab from another user's account: what the isolation tests share.

``tests/test_isolation.py`` (the user ``nobody`` against a lab of root's) and
``tests/test_hub.py`` (three students on a JupyterHub against each other's labs)
ask the same question: can a process of another user connect to any socket of
this lab, or enter its ranks' network? ``lab_sockets`` lists what a running lab
listens on, from outside it (root sees every process); ``connect_as`` tries it
all from a process of another user.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import psutil
from conftest import listening_addresses

# Run as the other user: try every TCP port on 127.0.0.1 and every Unix socket path given.
CONNECT = textwrap.dedent("""
    import json, socket, sys
    ports, paths, namespaces = json.loads(sys.argv[1])
    accepted = []
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    for path in namespaces:           # the ranks' network itself: entering it needs privilege
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        if libc.setns(fd, 0x40000000) == 0:
            accepted.append(f"netns {path}")
        os.close(fd)
    for port in ports:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            accepted.append(f"tcp {port}")
        except OSError:
            pass
    for path in paths:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect("\\0" + path[1:] if path.startswith("@") else path)   # @: abstract
            accepted.append(f"unix {path}")
        except OSError:
            pass
    print(json.dumps(accepted))
""")


def runs_as(python: str, uid: int) -> bool:
    """Whether user ``uid`` may run ``python`` (an interpreter under /root is out of its reach)."""
    try:
        return subprocess.run([python, "-c", ""], user=uid, group=uid, extra_groups=[],
                              cwd="/", capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def connect_as(uid: int, gid: int, python: str, ports: list[int], paths: list[str],
               namespaces: list[str] = ()) -> list[str]:
    """What user ``uid`` could connect to or enter: ``ports`` on 127.0.0.1, Unix socket
    ``paths``, network ``namespaces`` (``/proc/PID/ns/net``). ``python``: one that user may
    run (connecting needs only the standard library)."""
    done = subprocess.run([python, "-c", CONNECT, json.dumps([ports, paths, list(namespaces)])],
                          user=uid, group=gid, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def lab_sockets(controller_pid: int, engine_pids: list[int]) -> tuple[list[int], list[str]]:
    """Every TCP port a running lab listens on, in any network, and every Unix socket of its
    tree (its controller, its engines and what they started): ``(ports, paths)``.

    The ranks' ports are read from ``/proc/PID/net/tcp`` of each engine, which shows the
    engine's own network; a port found there may also be in use on this machine's network
    by something else, so callers drop those (``in_use_here``) before trying them.
    """
    tree = {controller_pid, *engine_pids}
    for pid in list(tree):
        tree.update(child.pid for child in psutil.Process(pid).children(recursive=True))
    ports, paths = listening_here(tree)
    ports = set(ports) | {port for pid in engine_pids for _, port in listening_addresses(pid)}
    return sorted(ports), paths


def listening_here(pids: set[int]) -> tuple[list[int], list[str]]:
    """The TCP ports on this machine's network that processes ``pids`` listen on, and their Unix
    sockets: by path, and abstract ones (``@name``, which no file permission guards)."""
    ports = {c.laddr.port for c in psutil.net_connections("inet")
             if c.status == psutil.CONN_LISTEN and c.pid in pids}
    paths = {c.laddr for c in psutil.net_connections("unix") if c.pid in pids and c.laddr}
    return sorted(ports), sorted(p for p in paths if p.startswith(("/", "@")))


def in_use_here() -> set[int]:
    """TCP ports listening on this machine's own network (reaching one says nothing of a lab)."""
    return {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}
