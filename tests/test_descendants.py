"""Issue 19 item 2: what a rank starts (multiprocessing, subprocess, os.fork) ends with the lab."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import alive

from ddplab import procs

pytestmark = pytest.mark.slow


def _mp_child():
    import multiprocessing
    import time
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    child.start()
    return child.pid


def _popen_child():
    import subprocess
    return subprocess.Popen(["sleep", "300"]).pid


def _forked_orphan():
    # A double fork: the grandchild's parent exits at once, so it is re-parented (an orphan).
    import os
    import time
    read, write = os.pipe()
    if os.fork() == 0:
        if os.fork() == 0:
            os.write(write, str(os.getpid()).encode().ljust(16))
            time.sleep(300)
            os._exit(0)
        os._exit(0)
    return int(os.read(read, 16))


WAYS = [_mp_child, _popen_child, _forked_orphan]


def _gone(pids, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("way", WAYS, ids=lambda f: f.__name__)
def test_restart_ends_what_ranks_started(fresh_lab, way):
    pids = fresh_lab.run(way)
    assert all(alive(pid) for pid in pids)
    fresh_lab.restart()
    assert _gone(pids), [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("way", WAYS, ids=lambda f: f.__name__)
def test_stop_ends_what_ranks_started(fresh_lab, way):
    pids = fresh_lab.run(way)
    fresh_lab.stop()
    try:
        assert _gone(pids), [pid for pid in pids if alive(pid)]
    finally:
        fresh_lab.restart()


SCRIPT = textwrap.dedent("""
    import sys, ddplab
    sys.path.insert(0, {tests!r})
    from test_descendants import {way}
    lab = ddplab.start(world_size=2, backend="gloo", timeout=60)
    print("PIDS", *lab.run({way}), flush=True)
    {end}
""")


@pytest.mark.parametrize("end", ["kill", "exit"])
@pytest.mark.parametrize("way", WAYS, ids=lambda f: f.__name__)
def test_kernel_end_ends_what_ranks_started(way, end):
    tests = os.path.dirname(__file__)
    body = "import time; time.sleep(300)" if end == "kill" else "pass   # exits without stop()"
    script = SCRIPT.format(tests=tests, way=way.__name__, end=body)
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = kernel.stdout.readline()
            assert line, "the script ended before its ranks started children"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2, pids
        if end == "kill":
            kernel.send_signal(signal.SIGKILL)
        kernel.wait(60)
        assert _gone(pids, 15), [pid for pid in pids if alive(pid)]
    finally:
        procs.end_tree(kernel, grace=5)
        kernel.wait()
