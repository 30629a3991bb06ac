"""Pure functions that decide what each rank is told: env vars, thread counts, the backend.

Nothing here starts a process, so ``ddplab.start`` can check every argument and
fail in well under a second before anything is launched.
"""

from __future__ import annotations

import math
import numbers
import os
import socket

from . import limits
from .errors import ConfigError
from .text import plural

#: Each rank is a process of its own, forked with torch loaded (about 40 MB of its
#: own, RANK_MEMORY_BYTES), and needs a share of a core: past 64 on one machine the
#: ranks mostly wait for cores (RANKS_PER_CORE), and a lab on hosts is the way on.
MAX_LOCAL_WORLD_SIZE = 64
BACKENDS = ("auto", "gloo", "nccl")
#: How the ranks meet, for ``ddplab.start(init_method=...)``: ``"store"`` is
#: ddplab's own race-free default; the others are torch's three URL schemes.
INIT_METHODS = ("store", "env", "tcp", "file")


def worker_env(rank: int, world_size: int, master_addr: str, master_port: int,
               local_rank: int | None = None, local_world_size: int | None = None,
               node_rank: int = 0, nnodes: int = 1) -> dict[str, str]:
    """The environment torchrun gives a worker, as a dict of strings.

    ``init_process_group(init_method="env://")`` reads exactly these, which is
    why code written for torchrun runs unchanged on a ddplab rank::

        >>> worker_env(1, 2, "127.0.0.1", 29500)["RANK"]
        '1'
    """
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    return {
        "RANK": str(rank),                          # global rank, 0..WORLD_SIZE-1
        "LOCAL_RANK": str(local_rank),              # rank on this machine: picks the GPU
        "WORLD_SIZE": str(world_size),              # processes in the whole job
        "LOCAL_WORLD_SIZE": str(local_world_size),  # processes on this machine
        "GROUP_RANK": str(node_rank),               # torchrun's name for the node rank
        "GROUP_WORLD_SIZE": str(nnodes),
        "MASTER_ADDR": master_addr,                 # where rank 0's TCPStore listens
        "MASTER_PORT": str(master_port),
    }


#: The variables ``worker_env`` sets, as torchrun names them: what a rank of ``ddplab.start``
#: gets, what bare ranks are started without, and what a launcher alone decides.
#: (``lab.run_script`` adds the rest of torchrun's, ``ROLE_*`` and ``TORCHELASTIC_*``.)
TORCHRUN_VARIABLES = tuple(worker_env(0, 1, "", 0))


def omp_threads(local_world_size: int, cpu_count: int | None = None) -> int:
    """OpenMP threads per rank: share the cores instead of oversubscribing them.

    torchrun sets 1 for every multi-process job; we give each rank its fair
    share of the CPUs this process may use (``ddplab.limits.cpus``: affinity and
    the cgroup's quota, not the host's count), which is never less than 1.
    """
    cpus = cpu_count or limits.cpus()
    return max(1, cpus // max(1, local_world_size))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it).

    Another process can take it before you bind it. ddplab's own rendezvous
    avoids that race: a local lab needs no port (its store is a file), and a
    multi-host lab's rank 0 binds port 0 for its TCPStore and reports the port it got.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Memory a local lab needs besides its ranks: the engine template's image of
#: torch (about 190 MB resident, most of it shared with every rank forked from
#: it) and the controller's six processes (about 50 MB), with some room.
LAB_MEMORY_BYTES = 256 * 2**20
#: Memory one rank needs until a rank of this kernel was measured: a forked rank
#: holds about 37 MB of its own (USS, torch 2.13 CPU, gloo, after an
#: all_reduce); twice that leaves room for a lesson's tensors and models.
RANK_MEMORY_BYTES = 64 * 2**20
#: A measured rank's own memory is multiplied by this for the estimate (room to work).
RANK_HEADROOM = 2
#: Past this many ranks per core they mostly wait for a core, and cells slow down.
RANKS_PER_CORE = 4
_measured_rank_bytes = 0


def note_rank_memory(pids: list[int]) -> None:
    """Measure what ranks just started cost of their own (the largest USS), for ``rank_memory``."""
    global _measured_rank_bytes
    import psutil
    try:
        _measured_rank_bytes = max(psutil.Process(pid).memory_full_info().uss for pid in pids)
    except (psutil.Error, ValueError):      # gone already, or no pids: keep what we had
        pass


def rank_memory() -> int:
    """Bytes to budget per rank: a measured rank's own memory with headroom, else the default."""
    if _measured_rank_bytes:
        return RANK_HEADROOM * _measured_rank_bytes
    return RANK_MEMORY_BYTES


def check_fits(world_size: int, available: int | None = None, cores: int | None = None) -> str:
    """Refuse a local lab this process's memory cannot hold; return a warning past the cores.

    Returns ``""`` when the lab fits comfortably. ``available`` (bytes) and
    ``cores`` default to what this process may use (``ddplab.limits``): the
    machine's free memory or its cgroup's room, the CPUs of its affinity and
    cgroup quota. A lab needs ``LAB_MEMORY_BYTES`` plus ``rank_memory()`` per rank.
    """
    source = "this machine's free memory"
    if available is None:
        room = limits.memory()
        available, source = room.available, room.source
    cores = cores or limits.cpus()
    per_rank = rank_memory()
    fits = max(0, (available - LAB_MEMORY_BYTES) // per_rank)
    if world_size > fits:
        fix = (f"Use world_size={min(fits, 8)} or fewer (or free memory first)." if fits else
               "Free memory first, or ask for a larger memory limit.")
        raise ConfigError(
            f"ddplab: world_size={world_size} does not fit in {source}: a lab needs about "
            f"{LAB_MEMORY_BYTES >> 20} MB plus {per_rank >> 20} MB per rank, and "
            f"{available >> 20} MB are free, enough for {fits} {plural(fits, 'rank')}. {fix}")
    if world_size > RANKS_PER_CORE * cores:
        return (f"ddplab: warning: world_size={world_size} on {cores} CPU "
                f"{plural(cores, 'core')}: the ranks will take turns on the cores and every "
                f"cell will be slow. Up to {RANKS_PER_CORE * cores} ranks run well here.")
    return ""


def check_world_size(world_size: object) -> int:
    """Return ``world_size`` as an int, or raise ConfigError that names the fix."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise ConfigError(
            f"ddplab: world_size must be a whole number of ranks, but got {world_size!r} "
            f"({type(world_size).__name__}). Use for example world_size=2.")
    world_size = int(world_size)
    if world_size < 1:
        raise ConfigError(
            f"ddplab: world_size must be at least 1, but got {world_size}. "
            f"Use for example world_size=2.")
    if world_size > MAX_LOCAL_WORLD_SIZE:
        raise ConfigError(
            f"ddplab: world_size={world_size} is more ranks than one machine runs: each rank is a "
            f"process of its own that needs a share of a core ({RANKS_PER_CORE} ranks per core run "
            f"well) and memory ({rank_memory() >> 20} MB budgeted per rank). Use at most "
            f"{MAX_LOCAL_WORLD_SIZE} here, or spread the ranks over hosts: start(hosts=[...]).")
    return world_size


def check_timeout(value: object, name: str = "timeout", example: float = 60) -> float:
    """Return a positive, finite timeout in seconds, or raise ConfigError."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0 < value < math.inf):        # also rejects nan
        raise ConfigError(
            f"ddplab: {name} must be a positive, finite number of seconds, but got {value!r}. "
            f"Use for example {name}={example:g}.")
    return float(value)


def check_init_method(value: object) -> str:
    """Return ``value`` if it names one of ``INIT_METHODS``, or raise ConfigError.

    ddplab builds the URL itself (a free port, a fresh file), so it takes the
    scheme's name, ``"env"``, not a URL such as ``"env://"``.
    """
    if value is None or (isinstance(value, str) and value in INIT_METHODS):
        return value      # None: bare ranks, the student calls init_process_group
    known = ", ".join(repr(m) for m in INIT_METHODS)
    scheme = value.split("://")[0] if isinstance(value, str) and "://" in value else None
    if scheme in INIT_METHODS:
        raise ConfigError(
            f"ddplab: init_method={value!r} is a URL, but ddplab builds the URL itself (a free "
            f"port, a fresh file). Use init_method={scheme!r}.")
    raise ConfigError(f"ddplab: init_method={value!r} is not one ddplab knows. Use one of {known}, "
                      f"or None for bare ranks that call init_process_group themselves.")


def nccl_fits(local_world_size: int, gpus: int) -> bool:
    """The backend rule, the one every part of ddplab follows: nccl needs one GPU per rank.

    Each rank takes GPU ``LOCAL_RANK`` of its host, and nccl refuses two ranks
    on one GPU; so a host running ``local_world_size`` ranks needs that many GPUs.
    Otherwise gloo, which runs anywhere, on CPU tensors.
    """
    return gpus >= local_world_size


def _check_backend(requested: str) -> None:
    if requested not in BACKENDS:
        raise ConfigError(
            f"ddplab: backend={requested!r} is not one ddplab knows. "
            f"Use one of {', '.join(repr(b) for b in BACKENDS)}.")


def choose_backend(requested: str, world_size: int, gpu_count: int) -> tuple[str, str]:
    """Pick the process-group backend for ranks on this machine and say why: ``(backend, reason)``."""
    _check_backend(requested)
    gpus = f"{gpu_count} {plural(gpu_count, 'GPU')}"
    fits = nccl_fits(world_size, gpu_count)
    if requested == "nccl":
        if not fits:
            raise ConfigError(
                f"ddplab: backend='nccl' needs one GPU per rank, but this machine has {gpus} "
                f"for world_size={world_size}. Use backend='gloo' (CPU) or backend='auto'.")
        ranks = f"{world_size} {plural(world_size, 'rank')}"
        return "nccl", f"nccl as asked: {gpus} for {ranks}, one GPU per rank"
    if requested == "gloo":
        return "gloo", "gloo as asked"
    if fits:
        return "nccl", f"nccl: this machine has {gpus}, enough for one GPU per rank"
    if gpu_count:
        return "gloo", (f"gloo: this machine has {gpus} for {world_size} {plural(world_size, 'rank')}; "
                        f"nccl needs one GPU per rank")
    return "gloo", "gloo: this machine has no GPU"


def choose_host_backend(requested: str, hosts: list[tuple[str, int, int]]) -> tuple[str, str]:
    """``choose_backend`` for ranks on several hosts: ``hosts`` holds ``(address, ranks, GPUs)``.

    nccl only if every host has one GPU per rank it runs (``nccl_fits``).
    """
    _check_backend(requested)
    short = [host for host, ranks, gpus in hosts if not nccl_fits(ranks, gpus)]
    if requested == "gloo" or (requested == "auto" and short):
        why = "as asked" if requested == "gloo" else f"host {short[0]} has fewer GPUs than ranks"
        return "gloo", f"gloo: {why}"
    if short:
        raise ConfigError(f"ddplab: backend='nccl' needs one GPU per rank on every host, but "
                          f"host {short[0]} has fewer GPUs than ranks. Use backend='gloo' or "
                          f"fewer ranks there.")
    return "nccl", "nccl: every host has one GPU per local rank"


def gpu_count() -> int:
    """How many CUDA GPUs this process can see.

    Without an NVIDIA or AMD driver there can be none, so we answer 0 without
    paying the second it takes to import torch.
    """
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/kfd")):
        return 0
    import torch
    return torch.cuda.device_count()
