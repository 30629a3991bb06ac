"""Every way a real Jupyter kernel ends, after a hang, leaves no process and no file.

The kernel is started with jupyter_client, as JupyterLab starts it, with a
``TMPDIR`` of its own, so "nothing left in /tmp" is "that folder is empty". It
starts a lab, hangs it (only rank 0 calls ``all_reduce``), and is then ended:

- ``shutdown``: Kernel > Shut down (``shutdown_kernel(now=False)``): a shutdown
  request; about 2.5 s later Jupyter sends SIGTERM, later SIGKILL. The lab's own
  exit handler must run first and quickly (it once ran after ipyparallel's and
  the template's, and the kernel was killed before it removed the directory).
- ``now``: ``shutdown_kernel(now=True)``, what a restart or a dead front end does: SIGKILL.
- ``sigkill``: ``kill -9`` of the kernel alone; the lab's processes notice and clean up.
- ``sigkill_midway``: ``kill -9`` after the controller is gone but before the
  directory is removed (a kernel killed halfway through its exit): the engine
  template removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import psutil
import pytest
from conftest import alive
from jupyter_client.manager import KernelManager

from ddplab import procs

pytestmark = pytest.mark.slow

START = "import ddplab\nlab = ddplab.start(world_size=2, backend='gloo', timeout=3)"
HANG = "%%ranks\nif rank == 0:\n    dist.all_reduce(torch.ones(1))\n"
# What "killed halfway through its exit" leaves: the controller ended, the directory not yet removed.
END_CONTROLLER = ("from ddplab import procs\n"
                  "procs.end_tree(lab.controller_pid, grace=5)")


def execute(client, code: str, limit: float = 180) -> dict[str, str]:
    """Run ``code`` in the kernel; its error (``ename``, ``evalue``) if it raised, else {}."""
    msg_id = client.execute(code)
    error: dict[str, str] = {}
    deadline = time.monotonic() + limit
    while True:
        msg = client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error = {"ename": msg["content"]["ename"], "evalue": msg["content"]["evalue"]}
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return error


def end(manager: KernelManager, client, how: str) -> None:
    kernel = manager.provisioner.process.pid
    if how == "shutdown":
        manager.shutdown_kernel(now=False)
    elif how == "now":
        manager.shutdown_kernel(now=True)
    else:
        if how == "sigkill_midway":
            assert execute(client, END_CONTROLLER) == {}
        procs.send(kernel, signal.SIGKILL)
        manager.shutdown_kernel(now=True)       # what the server does next: reap, clean up


@pytest.mark.parametrize("how", ["shutdown", "now", "sigkill", "sigkill_midway"])
def test_a_hung_lab_leaves_nothing_however_the_kernel_ends(how):
    tmp = tempfile.mkdtemp(prefix="ddplab-test-tmp-")   # short: the template's socket lives in it
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=dict(os.environ, TMPDIR=tmp))
    client = manager.client()
    started: list[psutil.Process] = []
    try:
        client.start_channels()
        client.wait_for_ready(timeout=120)
        assert execute(client, f"import sys; assert sys.executable == {sys.executable!r}") == {}
        assert execute(client, START) == {}
        error = execute(client, HANG)
        assert error.get("ename") == "HangError", error
        started = psutil.Process(manager.provisioner.process.pid).children(recursive=True)
        assert len(started) >= 4, started                 # template, controller, 2 engines at least
        assert sorted(name.rsplit("-", 1)[0] for name in os.listdir(tmp)) == \
            ["ddplab", "ddplab-template"]
        end(manager, client, how)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (os.listdir(tmp) or any(alive(p.pid) for p in started)):
            time.sleep(0.05)
        survivors = [f"{p.pid} {p.name()}" for p in started if alive(p.pid) and p.is_running()]
        assert survivors == [], f"after '{how}' these processes the kernel started still run"
        assert os.listdir(tmp) == [], f"after '{how}' the kernel left these in its TMPDIR"
    finally:
        client.stop_channels()
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
        procs.end_tree(*started, grace=0)                 # never leave one running, even on failure
        shutil.rmtree(tmp, ignore_errors=True)
