"""Pure functions that decide what each rank is told: env vars, thread counts, the backend.

Nothing here starts a process, so ``ddplab.start`` can check every argument and
fail in well under a second before anything is launched.
"""

from __future__ import annotations

import math
import numbers
import os
import socket

from .errors import ConfigError

#: Each rank is a full Python process with torch imported (roughly 300 MB), so
#: one machine runs out of memory long before it runs out of ranks.
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


def omp_threads(local_world_size: int, cpu_count: int | None = None) -> int:
    """OpenMP threads per rank: share the cores instead of oversubscribing them.

    torchrun sets 1 for every multi-process job; we give each rank its fair
    share of the cores, which is never less than 1.
    """
    cpus = cpu_count or os.cpu_count() or 1
    return max(1, cpus // max(1, local_world_size))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it).

    Another process can take it before you bind it; ddplab itself avoids that
    race by letting rank 0's TCPStore bind port 0 and reporting the port it got.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
            f"ddplab: world_size={world_size} is too many ranks for one machine: each rank is "
            f"a Python process with torch loaded (~300 MB). Use at most {MAX_LOCAL_WORLD_SIZE}.")
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
    if isinstance(value, str) and value in INIT_METHODS:
        return value
    known = ", ".join(repr(m) for m in INIT_METHODS)
    scheme = value.split("://")[0] if isinstance(value, str) and "://" in value else None
    if scheme in INIT_METHODS:
        raise ConfigError(
            f"ddplab: init_method={value!r} is a URL, but ddplab builds the URL itself (a free "
            f"port, a fresh file). Use init_method={scheme!r}.")
    raise ConfigError(f"ddplab: init_method={value!r} is not one ddplab knows. Use one of {known}.")


def choose_backend(requested: str, world_size: int, gpu_count: int) -> tuple[str, str]:
    """Pick the process-group backend and say why, as ``(backend, reason)``.

    nccl needs one GPU per rank: two ranks on one GPU is an error in nccl.
    gloo runs anywhere, on CPU tensors.
    """
    if requested not in BACKENDS:
        raise ConfigError(
            f"ddplab: backend={requested!r} is not one ddplab knows. "
            f"Use one of {', '.join(repr(b) for b in BACKENDS)}.")
    gpus = f"{gpu_count} GPU{'s' if gpu_count != 1 else ''}"
    if requested == "nccl":
        if gpu_count < world_size:
            raise ConfigError(
                f"ddplab: backend='nccl' needs one GPU per rank, but this machine has {gpus} "
                f"for world_size={world_size}. Use backend='gloo' (CPU) or backend='auto'.")
        return "nccl", f"nccl as asked: {gpus} for {world_size} ranks, one GPU per rank"
    if requested == "gloo":
        return "gloo", "gloo as asked"
    if gpu_count >= world_size:
        return "nccl", f"nccl: this machine has {gpus}, enough for one GPU per rank"
    if gpu_count:
        return "gloo", (f"gloo: this machine has {gpus} for {world_size} ranks; "
                        f"nccl needs one GPU per rank")
    return "gloo", "gloo: this machine has no GPU"


def gpu_count() -> int:
    """How many CUDA GPUs this process can see.

    Without an NVIDIA or AMD driver there can be none, so we answer 0 without
    paying the second it takes to import torch.
    """
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/kfd")):
        return 0
    import torch
    return torch.cuda.device_count()
