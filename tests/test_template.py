"""Engines forked from a warm template: what they inherit, what they must not, and that
nothing outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import ddplab
from ddplab import procs
from ddplab.lab import template

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not template.enabled(), reason="the template needs fork (Linux)")]


def _torch_facts():
    import os
    import sys

    import torch
    return {"ppid": os.getppid(), "threads": torch.get_num_threads(),
            "debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
            "sum": float((torch.ones(64, 64) @ torch.ones(64, 64)).sum()),
            "torch_loaded_before_main": "torch" in sys.modules}


# Run in a process of its own: in this test process the session's labs also use the
# template, and the point is that the *last* lab's stop() ends it.
ONE_TEMPLATE = textwrap.dedent("""
    import os, psutil, ddplab
    from ddplab.env import omp_threads
    from ddplab.lab import template

    def _torch_facts():
        import os, torch
        return {"ppid": os.getppid(), "threads": torch.get_num_threads(),
                "sum": float((torch.ones(64, 64) @ torch.ones(64, 64)).sum())}

    with ddplab.start(world_size=2, backend="gloo") as lab:
        shared = template.shared()
        facts = lab.run(_torch_facts)
        # Each engine is a child of this kernel's template, which has no thread of its own
        # (forking a process with threads can copy a held lock into the child).
        assert {f["ppid"] for f in facts} == {shared.process.pid}, facts
        assert psutil.Process(shared.process.pid).num_threads() == 1
        assert [f["threads"] for f in facts] == [omp_threads(2)] * 2, facts
        assert [f["sum"] for f in facts] == [64.0 ** 3] * 2, facts
        # A restart, and a lab that replaces this one, reuse the same template.
        lab.restart()
        assert {f["ppid"] for f in lab.run(_torch_facts)} == {shared.process.pid}
        second = ddplab.start(world_size=3, backend="gloo")
        assert {f["ppid"] for f in second.run(_torch_facts)} == {shared.process.pid}
        lab.stop()                      # the replaced lab: the running one keeps the template
        assert shared.alive and second.run(lambda: 1) == [1] * 3
        second.stop()
    # The last lab's stop() ends it: nothing ddplab started is left.
    assert shared.process.poll() is not None
    assert not os.path.exists(shared.directory)
    print("OK")
""")


def test_engines_are_forked_from_one_template_and_set_their_own_threads():
    result = subprocess.run([sys.executable, "-c", ONE_TEMPLATE], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), \
        result.stdout + result.stderr


def test_a_restart_keeps_the_controller_and_leaks_nothing_in_the_kernel():
    with ddplab.start(world_size=1, backend="gloo") as lab:
        controller = lab.controller_pid
        lab.restart()                                  # warm up whatever is made once
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        for _ in range(20):
            old = lab.pids
            lab.restart()
            assert lab.pids != old and not any(psutil.pid_exists(p) for p in old)
            assert lab.run(lambda: 7) == [7]
        assert lab.controller_pid == controller
        assert len(os.listdir("/proc/self/fd")) <= fds, "file descriptors leak per restart"
        assert threading.active_count() <= threads, "threads leak per restart"


def test_debug_mode_reaches_forked_engines():
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported, which
    # the template did before the rank's environment existed: the child reads it again.
    with ddplab.start(world_size=2, backend="gloo", debug=True) as lab:
        import torch.distributed as dist
        levels = lab.run(lambda: str(dist.get_debug_level()))
        assert levels == ["DebugLevel.DETAIL"] * 2


def test_plain_processes_when_fork_is_off(monkeypatch):
    monkeypatch.setenv("DDPLAB_FORK", "0")
    with ddplab.start(world_size=2, backend="gloo") as lab:
        facts = lab.run(_torch_facts)
        assert all(f["ppid"] != getattr(template._template, "process", None) for f in facts)
        assert [f["sum"] for f in facts] == [64.0 ** 3] * 2


KERNEL = textwrap.dedent("""
    import sys, ddplab
    from ddplab.lab import template
    lab = ddplab.start(world_size=2, backend="gloo")
    print("PIDS", template.shared().process.pid, template.shared().directory, *lab.pids, flush=True)
    sys.stdin.read()        # until killed
""")


def test_template_and_engines_die_with_a_killed_kernel():
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        fields = next((line.split()[1:] for line in kernel.stdout if line.startswith("PIDS")), None)
        assert fields, "the kernel did not start its lab"
        template_pid, directory, engines = int(fields[0]), fields[1], [int(p) for p in fields[2:]]
        assert os.path.isdir(directory)
        procs.send(kernel, signal.SIGKILL)            # the kernel only: the rest must notice
        kernel.wait()
        # The template polls its parent every POLL_SECONDS, the engines poll the template.
        deadline = time.monotonic() + 20 * template_poll()
        while time.monotonic() < deadline and (
                any(psutil.pid_exists(p) for p in [template_pid, *engines]) or os.path.exists(directory)):
            time.sleep(0.05)
        alive = [p for p in [template_pid, *engines] if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"still running after the kernel died: {alive}"
        assert not os.path.exists(directory), f"the template left {directory} behind"
    finally:
        procs.end_tree(kernel, grace=5)
        kernel.wait()


def template_poll() -> float:
    from ddplab.rank import template as rank_template, tether
    return max(rank_template.POLL_SECONDS, tether.POLL_SECONDS)


BORROWER = textwrap.dedent("""
    import os, sys, ddplab
    from ddplab.lab import template
    lab = ddplab.start(world_size=2, backend="gloo")
    assert isinstance(template.shared(), template.BorrowedTemplate)
    print("PIDS", lab.directory, *lab.run(os.getppid), *lab.pids, flush=True)
    if sys.argv[1] == "stop":
        lab.stop()                  # ends the lab, not the template it borrowed
        print("STOPPED", flush=True)
    sys.stdin.read()                # until killed, or stdin closes
""")


def test_kernels_borrow_one_template_that_ends_a_dead_kernels_engines():
    """``ddplab grade``'s set-up: one template, many kernels; a dead kernel's engines end with it."""
    shared = template.Template()
    shared.wait_ready()
    env = dict(os.environ, **{template.BORROW_ENV: shared.socket_path})
    kernels = []
    try:
        def borrower(how: str) -> tuple[subprocess.Popen, list[str]]:
            kernel = subprocess.Popen([sys.executable, "-c", BORROWER, how], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
            kernels.append(kernel)
            fields = next((line.split()[1:] for line in kernel.stdout if line.startswith("PIDS")), None)
            assert fields, "the kernel did not start its lab"
            return kernel, fields

        killed, (directory, *pids) = borrower("kill")
        parents, engines = [int(p) for p in pids[:2]], [int(p) for p in pids[2:]]
        assert parents == [shared.process.pid] * 2, "engines not forked from the borrowed template"
        procs.send(killed, signal.SIGKILL)            # the kernel only: the template must notice
        killed.wait()
        deadline = time.monotonic() + 20 * template_poll()
        while time.monotonic() < deadline and (
                any(procs.alive(p) for p in engines) or os.path.exists(directory)):
            time.sleep(0.05)
        assert not [p for p in engines if procs.alive(p)], "a dead kernel's engines still run"
        assert not os.path.exists(directory), f"{directory} left behind"
        assert shared.alive, "one kernel's death ended the template the others share"

        # The template still serves the next kernel, whose lab.stop() leaves it running.
        polite, (_, *pids) = borrower("stop")
        assert [int(p) for p in pids[:2]] == [shared.process.pid] * 2
        assert next(line for line in polite.stdout if line.strip()) == "STOPPED\n"
        polite.stdin.close()
        assert polite.wait(timeout=60) == 0
        assert shared.alive
    finally:
        for kernel in kernels:
            procs.end_tree(kernel, grace=5)
            kernel.wait()
        shared.stop()
    assert shared.process.poll() is not None and not os.path.exists(shared.directory)


ORPHANED_BORROWER = textwrap.dedent("""
    import os, ddplab
    from ddplab.lab import template
    with ddplab.start(world_size=2, backend="gloo") as lab:
        own = template.shared()
        assert type(own) is template.Template, type(own)
        assert lab.run(os.getppid) == [own.process.pid] * 2, "engines not forked from its own template"
        print("RANKS", *lab.run(lambda: __import__("torch.distributed").distributed.get_rank()))
""")


def test_a_kernel_whose_borrowed_template_died_forks_from_its_own():
    """A grading run's template killed mid-class: the next submissions still run, one import slower."""
    dead = template.Template()
    dead.wait_ready()
    procs.send(dead.process, signal.SIGKILL)          # no clean-up: its socket file stays
    dead.process.wait()
    try:
        assert os.path.exists(dead.socket_path), "the test needs the dead template's socket file"
        env = dict(os.environ, **{template.BORROW_ENV: dead.socket_path})
        result = subprocess.run([sys.executable, "-c", ORPHANED_BORROWER], capture_output=True,
                                text=True, env=env, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "RANKS 0 1\n" in result.stdout, result.stdout
    finally:
        dead.stop()
