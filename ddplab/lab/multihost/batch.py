"""Engines started by Slurm (``sbatch``) or by ``mpiexec``: ipyparallel's launchers, watched.

ipyparallel submits the job or runs mpiexec and returns; if the engines then
die at once (no ddplab on the nodes' Python, mpiexec refusing root, no
mpi4py), nothing tells the kernel, which waited out its timeout. Here:

- ``check_mpi`` finds MPI's needs before anything starts: ``mpiexec``,
  mpi4py and ddplab in ``remote_python``, and Open MPI's
  ``--allow-run-as-root`` when run as root, each named in the error;
- ``failure(launcher)`` says, while the kernel waits for engines, whether the
  job or mpiexec already ended (``squeue``, the process), with its output;
- ``run_watched``: mpiexec runs under ``python -m ddplab.lab.multihost.batch
  KERNEL_PID mpiexec ...``, which ends it (and so its ranks) within a second
  once the kernel is gone, even killed;
- ``SlurmEngineSetLauncher`` writes the batch file into the lab's own directory (not
  the working directory), runs ``srun --kill-on-bad-exit=1`` so one failed
  rank ends the job, and ``stop_job`` waits until Slurm has ended it.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import psutil
from ipyparallel.cluster import launcher as ipp_launcher
from ipyparallel.cluster.launcher import MPIEngineSetLauncher

from ... import procs
from ...errors import ConfigError, DdplabError

log = logging.getLogger(__name__)

#: Slurm job states in which the engines may still come up.
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"}


_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{cluster_id}
srun --kill-on-bad-exit=1 {program_and_args}
"""


class SlurmEngineSetLauncher(ipp_launcher.SlurmEngineSetLauncher):
    """ipyparallel's Slurm launcher (same settings), whose job ends when one engine fails."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.default_template = _TEMPLATE      # what a batch_template you set replaces

    def _run_command(self, command: list[str], **kwargs) -> str:
        """sbatch / scancel; when one fails, what it said is the error (ipyparallel drops it)."""
        out = procs.run_command(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=60, **kwargs)
        if out.returncode:
            raise DdplabError(f"ddplab: `{shlex.join(command)}` failed with exit code "
                              f"{out.returncode}: {(out.stderr + out.stdout).strip()}")
        return out.stdout


def read(path: str, limit: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-limit:].decode("utf-8", "replace")
    except OSError:
        return ""


def job_state(job_id: str) -> tuple[str, str]:
    """(state, reason) of a Slurm job; ("", why) when Slurm no longer knows it."""
    try:
        out = procs.run_command(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T|%r"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", str(e)
    line = out.stdout.strip()
    if out.returncode or not line:
        return "", (out.stderr.strip() or "not in squeue")
    state, _, reason = line.partition("|")
    return state, reason


def failure(launcher, kind: str) -> str | None:
    """Why the engines of this launcher cannot all come up now, or None while they may."""
    if kind == "slurm":
        if not launcher.job_id:
            return None
        state, reason = job_state(launcher.job_id)
        if state in _LIVE:
            return None
        time.sleep(0.3)                 # the job's last lines reach its log
        return (f"Slurm job {launcher.job_id} ended ({state or reason}) before its engines "
                f"registered. Its log:\n{read(launcher.output_file).rstrip() or '(empty)'}")
    if kind == "mpi":
        if launcher.pid <= 0 or _running(launcher.pid):
            return None
        code = (launcher.stop_data or {}).get("exit_code", "?")
        return (f"mpiexec (pid {launcher.pid}) exited with code {code} before its engines "
                f"registered. Its output:\n{read(launcher.output_file).rstrip() or '(empty)'}")
    return None


def waiting_on(launcher, kind: str) -> str:
    """What the engines are waiting for, for a timeout message."""
    if kind == "slurm" and launcher.job_id:
        state, reason = job_state(launcher.job_id)
        return f"Slurm job {launcher.job_id} is {state or 'gone'} ({reason})"
    if kind == "mpi":
        return f"mpiexec (pid {launcher.pid}) is {'running' if _running(launcher.pid) else 'gone'}"
    return ""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_job(launcher, timeout: float = 20.0) -> None:
    """scancel the job, and wait until Slurm has ended it (its processes with it)."""
    if not launcher.job_id:
        return
    procs.run_command(["scancel", str(launcher.job_id)], capture_output=True, timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job_state(launcher.job_id)[0] in _LIVE | {"COMPLETING"}:
        time.sleep(0.2)
    state = job_state(launcher.job_id)[0]
    if state in _LIVE | {"COMPLETING"}:
        log.warning("ddplab: Slurm job %s is still %s %g s after scancel", launcher.job_id, state,
                    timeout)


def stop_mpiexec(launcher) -> None:
    """End mpiexec (it ends its ranks) and reap it."""
    if launcher.pid > 0:
        procs.end_tree(launcher.pid, grace=5)
    popen = getattr(launcher, "_popen_process", None)
    if popen is not None:
        try:
            popen.wait(5)
        except Exception:
            log.debug("mpiexec did not exit", exc_info=True)


def check_mpi(remote_python: str, config: dict | None) -> None:
    """Raise ConfigError naming what ``engines="mpi"`` lacks here, before anything starts."""
    section = dict((config or {}).get("MPIEngineSetLauncher", {}))
    mpi_cmd = list(section.get("mpi_cmd", ["mpiexec"]))
    if shutil.which(mpi_cmd[0]) is None:
        raise ConfigError(f"ddplab: engines='mpi' runs {mpi_cmd[0]!r}, which is not on PATH. "
                          f"Install an MPI (apt-get install openmpi-bin) or pass "
                          f"config={{'MPIEngineSetLauncher': {{'mpi_cmd': ['/path/to/mpiexec']}}}}.")
    try:
        probe = procs.run_command(
            [remote_python, "-c", "import importlib.util as u; print(' '.join(m for m in "
             "('mpi4py', 'ddplab', 'ipyparallel') if u.find_spec(m) is None))"],
            capture_output=True, text=True, timeout=60)
        missing = probe.stdout.split() if probe.returncode == 0 else [probe.stderr.strip()]
    except OSError as e:
        missing = [str(e)]
    if missing:
        raise ConfigError(f"ddplab: engines='mpi' starts its engines with remote_python="
                          f"{remote_python!r}, which lacks {', '.join(missing)} (an MPI engine "
                          f"needs mpi4py, ddplab and ipyparallel). Install them there "
                          f"(pip install mpi4py), or pass remote_python= a Python that has them.")
    version = procs.run_command([*mpi_cmd, "--version"], capture_output=True, text=True, timeout=30)
    open_mpi = "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout
    allowed = "--allow-run-as-root" in section.get("mpi_args", []) or (
        os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") and os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"))
    if open_mpi and os.geteuid() == 0 and not allowed:
        raise ConfigError("ddplab: engines='mpi' would run Open MPI's mpiexec as root, which it "
                          "refuses without --allow-run-as-root. Run as a normal user, or pass "
                          "config={'MPIEngineSetLauncher': {'mpi_args': ['--allow-run-as-root']}}.")


def watched(mpi_cmd: list[str]) -> list[str]:
    """``mpi_cmd`` run under this kernel's watch (see ``run_watched``)."""
    return [sys.executable, "-m", "ddplab.lab.multihost.batch", str(os.getpid()), *mpi_cmd]


def run_watched(parent: int, command: list[str]) -> int:
    """Run ``command``; end its tree when ``parent`` is gone (or on SIGTERM/SIGINT); its exit code."""
    child = procs.start(command, session=False)
    ending = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: ending.append(True))
    while child.poll() is None:
        if ending or procs.parent_gone(parent):
            procs.end_tree(child, grace=2)
            break
        time.sleep(0.2)
    return child.wait()


__all__ = ["MPIEngineSetLauncher", "SlurmEngineSetLauncher", "check_mpi", "failure", "stop_job",
           "stop_mpiexec", "waiting_on", "run_watched", "watched"]


if __name__ == "__main__":
    sys.exit(run_watched(int(sys.argv[1]), sys.argv[2:]))
