"""Shared fixtures: real engines, real gloo. One 2-rank lab serves most tests.

Every test runs under the leak check (``leakcheck``): the suite has a temporary
folder of its own, and a test, module or notebook that leaves a ``ddplab-*``
entry there, or a live process, fails at its teardown, named.
"""

from __future__ import annotations

import leakcheck
import psutil
import pytest
from browserkit import require_chromium
from leakcheck import lab_dirs, my_process_tree  # noqa: F401  tests import them from here
from realhosts import *  # noqa: F401,F403  the realhosts tier's daemons (tests/realhosts.py)

import ddplab


def pytest_configure(config) -> None:
    leakcheck.install(config)


def pytest_collection_modifyitems(items) -> None:
    """Tests on the network-namespace hosts are the ``netns`` tier (root and iproute2)."""
    for item in items:
        if "hosts_lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.netns)


@pytest.fixture
def chromium() -> str:
    """The path of Debian's Chromium; skip (by hand) or fail (make test, CI) without it."""
    return require_chromium()


@pytest.fixture(scope="session")
def lab():
    """A running 2-rank gloo lab, restarted if a test left it broken."""
    with ddplab.start(world_size=2, backend="gloo", timeout=30) as lab:
        yield lab


@pytest.fixture
def fresh_lab(lab):
    """The session lab, guaranteed usable: restarted if an earlier test broke it."""
    if not lab.healthy:
        lab.restart()
    ddplab.lab.current_lab.make_current(lab)
    return lab


@pytest.fixture(scope="session")
def lab4():
    """A running 4-rank gloo lab, beside the 2-rank one (start() would replace that one)."""
    from ddplab.lab import Lab, LabSpec

    lab = Lab(LabSpec(world_size=4, backend="gloo", timeout=60, grace=2.0,
                      pg_timeout=1800, debug=False), gpus=0)
    lab.start()
    yield lab
    lab.stop()


@pytest.fixture
def fresh_lab4(lab4):
    """The 4-rank lab, usable and current, so checkers and ddplab.show find it."""
    if not lab4.healthy:
        lab4.restart()
    ddplab.lab.current_lab.make_current(lab4)
    return lab4


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """Every TCP (ip, port) listening in the network namespace of process ``pid``.

    Read from ``/proc/PID/net/tcp``, which shows that process's network, not
    ours: how a test sees into a lab's private network (ddplab.rank.netns).
    """
    import ipaddress
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)                                   # the header
            for line in f:
                local, state = line.split()[1], line.split()[3]
                if state != "0A":                     # TCP_LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)
                # The kernel prints the address as 32-bit words in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def fails(checker, *needles: str) -> str:
    """Run a checker that must reject the answer; return its message after checking key words."""
    with pytest.raises(AssertionError) as info:
        checker()
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def last_line(capsys) -> str:
    """The last line a checker printed (its one ``Correct: ...`` line)."""
    return capsys.readouterr().out.splitlines()[-1]
