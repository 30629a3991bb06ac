"""Limits come from this process's cgroup and affinity, not the host (ddplab.limits).

The fast tests read made-up cgroup trees (v1 and v2); the slow ones put a real
process in a real memory cgroup, or under a real CPU affinity, and check what a
lab does there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ddplab import limits
from ddplab.env import LAB_MEMORY_BYTES, omp_threads

MB = 2**20


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_v2_takes_the_tightest_limit_of_the_cgroup_and_its_ancestors(tmp_path):
    root = _tree(tmp_path, {
        "cgroup.controllers": "cpu memory",
        "user.slice/memory.max": str(1000 * MB), "user.slice/memory.current": str(100 * MB),
        "user.slice/cpu.max": "max 100000",
        "user.slice/alice/memory.max": "max", "user.slice/alice/memory.current": str(50 * MB),
        "user.slice/alice/cpu.max": "150000 100000",
    })
    room = limits.memory(root, "0::/user.slice/alice\n", machine_available=8000 * MB)
    assert (room.available, room.limit) == (900 * MB, 1000 * MB)
    assert room.source == "the cgroup limit of 1000 MB"
    assert limits.cpus(root, "0::/user.slice/alice\n") == min(2, len(os.sched_getaffinity(0)))


def test_v1_hierarchies_are_read_per_controller(tmp_path):
    root = _tree(tmp_path, {
        "memory/jobs/7/memory.limit_in_bytes": str(400 * MB),
        "memory/jobs/7/memory.usage_in_bytes": str(150 * MB),
        "memory/memory.limit_in_bytes": str(2**63 - 4096),       # the root: no limit
        "memory/memory.usage_in_bytes": str(4000 * MB),
        "cpu/jobs/cpu.cfs_quota_us": "100000", "cpu/jobs/cpu.cfs_period_us": "100000",
    })
    proc = "4:memory:/jobs/7\n1:cpu,cpuacct:/jobs\n0::/\n"
    room = limits.memory(root, proc, machine_available=8000 * MB)
    assert (room.available, room.limit) == (250 * MB, 400 * MB)
    assert limits.cpus(root, proc) == 1


def test_without_a_limit_the_machine_bounds_memory(tmp_path):
    root = _tree(tmp_path, {"memory/memory.limit_in_bytes": str(2**63 - 4096),
                            "memory/memory.usage_in_bytes": str(10 * MB)})
    room = limits.memory(root, "4:memory:/\n", machine_available=123 * MB)
    assert room == limits.Memory(123 * MB, None, "this machine's free memory")
    assert limits.cpus(root, "4:memory:/\n") == len(os.sched_getaffinity(0))


def test_omp_threads_follow_the_affinity():
    """Under `taskset -c 0` a one-rank lab gets one thread, not the host's core count."""
    code = ("import os; os.sched_setaffinity(0, {0}); "
            "from ddplab.env import omp_threads; print(omp_threads(1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "1"
    assert omp_threads(1) == len(os.sched_getaffinity(0))


def _memory_cgroup() -> Path | None:
    """A fresh memory cgroup we may write (root only), v2 if mounted with memory, else v1."""
    if os.geteuid() != 0:
        return None
    for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/memory")):
        controllers = base / "cgroup.controllers"
        v1 = base.name == "memory"
        if (v1 and (base / "memory.limit_in_bytes").exists()) or \
                (controllers.exists() and "memory" in controllers.read_text().split()):
            path = base / f"ddplab-test-{uuid.uuid4().hex[:8]}"
            try:
                path.mkdir()
            except OSError:
                continue
            return path
    return None


@pytest.mark.slow
def test_a_lab_larger_than_the_users_cgroup_is_refused_at_once_naming_the_limit():
    group = _memory_cgroup()
    if group is None:
        pytest.skip("no writable memory cgroup here (needs root)")
    try:
        v1 = (group / "memory.limit_in_bytes").exists()
        (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(400 * MB))
        code = ("import ddplab\n"
                "try:\n    ddplab.start(world_size=8, backend='gloo')\n"
                "except ddplab.ConfigError as e:\n    print('REFUSED', e)\n"
                "else:\n    print('STARTED')\n")
        # The shell joins the cgroup, then becomes Python: everything it starts is inside.
        begin = time.monotonic()
        result = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
             code], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - begin
        assert "REFUSED" in result.stdout, result.stdout + result.stderr[-2000:]
        message = result.stdout
        assert "world_size=8 does not fit in the cgroup limit of 400 MB" in message, message
        fits = (400 * MB - LAB_MEMORY_BYTES) // (64 * MB)      # at most this many
        assert "enough for " in message and "Use world_size=" in message, message
        assert int(message.split("enough for ")[1].split()[0]) <= fits
        # Refused before anything started: a start that went ahead waits its 60 s timeout.
        assert took < 0.5 * 60, f"refused after {took:.1f} s"
    finally:
        group.rmdir()


def test_grade_jobs_follow_the_affinity():
    """`ddplab grade`'s default --jobs counts the CPUs the grader may use, not the host's."""
    code = ("import os; os.sched_setaffinity(0, {0}); "
            "from ddplab.grade.class_run import default_jobs; print(default_jobs(available=2**50))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "4"                  # four per core, one core


@pytest.mark.slow
def test_grade_jobs_follow_the_users_cgroup_memory():
    """In a 5 GB cgroup `ddplab grade` runs two submissions at once (2 GB each), whatever the host has."""
    group = _memory_cgroup()
    if group is None:
        pytest.skip("no writable memory cgroup here (needs root)")
    try:
        v1 = (group / "memory.limit_in_bytes").exists()
        (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(5 * 2**30))
        code = "from ddplab.grade.class_run import default_jobs; print(default_jobs(cores=64))"
        result = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
             code], capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == "2", result.stdout + result.stderr[-2000:]
    finally:
        group.rmdir()
