"""What this process may use: CPUs and memory as its cgroup and affinity allow, not the host.

On a class server (JupyterHub with per-user limits, a Kubernetes pod, a Slurm
job) the machine's totals say nothing about one student's share:
``os.cpu_count()`` counts the host's cores and ``psutil.virtual_memory()`` its
free memory, while the kernel kills a student's rank as soon as the *user's*
cgroup is full. So every limit ddplab applies (``env.check_fits``,
``env.omp_threads``, ``ddplab grade --jobs``) asks this module:

- ``cpus()``: the CPUs this process may run on (``sched_getaffinity``: taskset,
  cpusets) and, if lower, the CPU quota of its cgroup (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us / cpu.cfs_period_us``), rounded up.
- ``memory()``: ``Memory(available, limit, source)``: the free memory of the
  machine, or, if less, what is left under the tightest ``memory.max`` (v2) or
  ``memory.limit_in_bytes`` (v1) of this process's cgroup and its ancestors.

Both read ``/proc/self/cgroup`` and the cgroup file systems under
``/sys/fs/cgroup``; ``root=`` and ``proc_cgroup=`` let tests point them at a
made-up tree.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: A v1 limit this large means "no limit" (the kernel's page-aligned LONG_MAX).
_NO_LIMIT_V1 = 2**62


@dataclass(frozen=True)
class Memory:
    """Memory this process may still use: ``available`` bytes, and where the bound comes from."""
    available: int
    limit: int | None          # the cgroup's limit in bytes, or None (only the machine bounds it)
    source: str                # "this machine's free memory" or "the cgroup limit of N MB"


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path}; the v2 hierarchy under key ``""``."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _levels(base: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``base`` and each ancestor up to ``base``."""
    node = base / path.lstrip("/")
    levels = []
    while True:
        levels.append(node)
        if node == base or base not in node.parents:
            return levels
        node = node.parent


def _v2_base(root: Path) -> Path:
    """Where the v2 hierarchy is mounted: the root itself, or ``unified/`` on hybrid systems."""
    return root if (root / "cgroup.controllers").exists() else root / "unified"


def _memory_limit(root: Path, paths: dict[str, str]) -> tuple[int, int] | None:
    """The tightest (limit, usage) in bytes over this cgroup and its ancestors, if any is set."""
    found: list[tuple[int, int]] = []
    if "" in paths:
        for level in _levels(_v2_base(root), paths[""]):
            limit, usage = _read(level / "memory.max"), _read(level / "memory.current")
            if limit and limit != "max" and usage:
                found.append((int(limit), int(usage)))
    if "memory" in paths:
        for level in _levels(root / "memory", paths["memory"]):
            limit = _read(level / "memory.limit_in_bytes")
            usage = _read(level / "memory.usage_in_bytes")
            if limit and usage and int(limit) < _NO_LIMIT_V1:
                found.append((int(limit), int(usage)))
    return min(found, key=lambda lu: lu[0] - lu[1]) if found else None


def _cpu_quota(root: Path, paths: dict[str, str]) -> float | None:
    """The tightest CPU quota (in CPUs) over this cgroup and its ancestors, if any is set."""
    quotas: list[float] = []
    if "" in paths:
        for level in _levels(_v2_base(root), paths[""]):
            text = _read(level / "cpu.max")
            if text and not text.startswith("max"):
                quota, _, period = text.partition(" ")
                quotas.append(int(quota) / int(period or 100000))
    if "cpu" in paths:
        for level in _levels(root / "cpu", paths["cpu"]):
            quota, period = _read(level / "cpu.cfs_quota_us"), _read(level / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0:
                quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def _proc_cgroup(proc_cgroup: str | None) -> str:
    if proc_cgroup is not None:
        return proc_cgroup
    return _read(Path("/proc/self/cgroup")) or ""


def cpus(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int:
    """How many CPUs this process can use at once: affinity, then the cgroup's quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # not Linux
        count = os.cpu_count() or 1
    quota = _cpu_quota(root, _cgroup_paths(_proc_cgroup(proc_cgroup)))
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def memory(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None,
           machine_available: int | None = None) -> Memory:
    """Memory this process may still use: the machine's free memory or its cgroup's room."""
    if machine_available is None:
        import psutil
        machine_available = psutil.virtual_memory().available
    bound = _memory_limit(root, _cgroup_paths(_proc_cgroup(proc_cgroup)))
    if bound is not None and bound[0] - bound[1] < machine_available:
        limit, usage = bound
        return Memory(max(0, limit - usage), limit, f"the cgroup limit of {limit >> 20} MB")
    return Memory(machine_available, None, "this machine's free memory")
