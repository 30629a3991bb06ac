"""Run ``torchrun`` and ``torch.multiprocessing.spawn`` from a notebook cell, as subprocesses.

    from ddplab import launch
    result = launch.torchrun("train.py", nproc_per_node=2)              # one node
    result = launch.torchrun("show_env.py", nproc_per_node=2, nnodes=2)  # two "nodes" on 127.0.0.1
    result = launch.torchrun("train.py", "50", "10", max_restarts=1)  # any torchrun option
    result = launch.spawn("spawn_demo.py", nprocs=2)   # python spawn_demo.py 2 PORT
    result = launch.spawn("spawn_nodes.py", nprocs=2, nnodes=2)  # ... 2 PORT 0 2, and ... 2 PORT 1 2
    result = launch.spawn("multigpu.py", "50", "10")   # python multigpu.py 50 10: its own arguments
    print(result.output_by_rank())                    # each rank's output, rank 0 first

A cell cannot hand ``mp.spawn`` or ``torchrun`` a function defined in the
notebook: both start fresh Python processes that must import the code. So the
code lives in a script file, and this module runs the launcher on it.

What it guarantees:

- Ports come from the OS (``ddplab.env.free_port``), never a fixed 29500, so
  two launches, or a launch beside a lab, do not collide.
- ``timeout`` is a no-progress one: a job that prints or computes runs on; one whose
  processes neither print nor use the CPU for ``timeout`` s is stuck (``procs.Group.wait``).
- Every process a launch started is ended when it returns, even when the script fails
  or hangs: the launcher's session, and every process it started (torchrun puts each
  worker in a session of its own, so ddplab notes them while it waits), by one ``procs.Group``.
- Output comes back per rank, in rank order: torchrun writes each worker's
  stdout to its own file (``--log-dir``/``--redirects``); for ``spawn``, lines
  a rank prints as ``[rank N] ...`` are grouped under rank N. Ports and
  temporary paths are replaced by ``PORT`` and ``<dir>``, so shown output is the
  same on every run.
- ``report_env()`` in a script records the torch.distributed variables it sees
  (``result.reports``, by rank). Every attempt of a job restarted by ``max_restarts``
  keeps its output, under ``[attempt K]`` lines (``result.attempts`` counts them).
- A launch whose processes all exit 0 without any of them forming a process
  group (a GPU-only script on a machine without GPUs skips its training) does
  not read "ok": ``result.groups_formed`` is 0 and its repr says so. The
  launched processes tell ddplab, through a ``sitecustomize`` on their
  ``PYTHONPATH``, each time one of them forms a group.

A failed launch raises ``LaunchError`` with each rank's output and the
launcher's own last lines; ``check=False`` returns the ``Launch`` instead.
Every launch runs through one job runner (``ddplab.launch.job``), as
``ddplab.train``'s launches do, with one failure report (``failure``).

Which to use: code in a file that starts its own processes (torchrun,
``mp.spawn``), as it would be run on a cluster, goes through here. A function,
or a script written for torchrun, that should run on the lab's own ranks (output
by rank in the notebook, globals kept for ``%%ranks``, the lab's debugger and
trace) goes through ``lab.spawn`` or ``lab.run_script``; their hang reports use
the same words (``ddplab.lab.verdicts``).
"""

from __future__ import annotations

import difflib
import json
import os
import sys

from ..env import check_timeout, check_world_size, free_port
from ..errors import ConfigError, LaunchError as LaunchError
from . import job
from .failure import command_line as command_line  # public: a launch as you would type it
from .job import ENV_NAMES as ENV_NAMES, Launch as Launch, env_table as env_table

HOST = "127.0.0.1"


def report_env(**extra) -> dict:
    """Call inside a launched process: record the variables it sees, and return them.

    Records ``ENV_NAMES`` (None where unset), ``dist.get_rank()`` and
    ``dist.get_world_size()`` if the group is up, and ``extra``. Under a
    ddplab launch it is also written where ``Launch.reports`` finds it.
    """
    import torch.distributed as dist

    report = {name: os.environ.get(name) for name in ENV_NAMES}
    if dist.is_available() and dist.is_initialized():
        report["dist.get_rank()"] = dist.get_rank()
        report["dist.get_world_size()"] = dist.get_world_size()
    report.update(extra)
    folder = os.environ.get(job.REPORT_DIR)
    if folder:
        key = report.get("dist.get_rank()", report["RANK"] or os.getpid())
        path = os.path.join(folder, f"report-{key}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)    # whole or absent, never half-written
    return report


# --------------------------------------------------------------------- launchers
def torchrun(script: str, *args: str, nproc_per_node: int = 2, nnodes: int = 1,
             timeout: float = 120, check: bool = True, **options: object) -> Launch:
    """Run ``torchrun`` on ``script``, on 127.0.0.1, and wait for it.

    Any other torchrun option is passed on: ``max_restarts=1`` becomes
    ``--max-restarts=1``, ``rdzv_backend="c10d"`` ``--rdzv-backend=c10d`` (at a
    free ``--rdzv-endpoint`` unless given), ``standalone=True`` ``--standalone``.

    With ``nnodes=2`` it starts two torchrun invocations at once, ``--node_rank
    0`` and ``1``, which meet at one free ``--master_port`` and form one group
    of ``nnodes * nproc_per_node`` ranks: a two-machine job, simulated on one.
    Rank ``node_rank * nproc_per_node + local_rank``'s output is
    ``rank_output[that rank]``.
    """
    _check_count(nproc_per_node, "nproc_per_node", "processes")
    _check_count(nnodes, "nnodes", "nodes")
    check_world_size(nproc_per_node * nnodes)
    timeout = check_timeout(timeout, example=120)
    port = free_port(HOST)
    extra = torchrun_options(options, port)
    commands = [torchrun_command([script, *map(str, args)], nnodes=nnodes, node_rank=node,
                                 nproc_per_node=nproc_per_node, master_port=port,
                                 log_dir=f"{{dir}}/logs-node{node}", options=extra)
                for node in range(nnodes)]
    return job.run(commands, timeout, check=check, ports=[port], torchrun_nproc=nproc_per_node)


#: torchrun options ddplab sets itself, and why.
_OWN_OPTIONS = {"log_dir": "output is read from there, by rank", "redirects": "output is read "
                "from a file per rank", "node_rank": "nnodes=N starts node ranks 0..N-1",
                "master_addr": f"ranks meet on {HOST}", "master_port": "it picks a free one"}


#: What other launchers (mp.spawn, launch.spawn, accelerate, mpirun) call torchrun's options.
_OTHER_NAMES = {"nprocs": "nproc_per_node=N (processes on each node; launch.spawn calls it "
                          "nprocs)",
                "nproc": "nproc_per_node=N", "num_processes": "nproc_per_node=N",
                "np": "nproc_per_node=N", "world_size": "nproc_per_node=N (with nnodes=M: "
                                                       "N * M ranks in all)"}


def torchrun_options(options: dict[str, object], port: int) -> list[str]:
    """``{"max_restarts": 1}`` as ``["--max-restarts=1"]``; ConfigError for options torchrun lacks."""
    from torch.distributed.run import get_args_parser
    known = {s for a in get_args_parser()._actions for s in a.option_strings}
    words = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if name in _OWN_OPTIONS:
            raise ConfigError(f"ddplab: launch.torchrun sets {flag} itself ({_OWN_OPTIONS[name]}), "
                              f"so {name}={value!r} cannot be passed. Leave it out.")
        if flag not in known:
            close = [c.lstrip("-").replace("-", "_") + "=...? "
                     for c in difflib.get_close_matches(flag, sorted(known), n=1)]
            if name in _OTHER_NAMES:
                close = [f"{_OTHER_NAMES[name]}? "]
            hint = "".join(f"Did you mean {c}" for c in close)
            raise ConfigError(f"ddplab: launch.torchrun got {name}={value!r}, but torchrun has no "
                              f"option {flag}. {hint}Options are torchrun's, with _ for -: "
                              f"max_restarts=1.")
        if value not in (False, None):
            words.append(flag if value is True else f"{flag}={value}")
    if "rdzv_backend" in options and "rdzv_endpoint" not in options:
        words.append(f"--rdzv-endpoint={HOST}:{port}")
    return words


def torchrun_command(target: list[str], *, nnodes: int, node_rank: int, nproc_per_node: int,
                     master_port: int, master_addr: str = HOST, log_dir: str = "",
                     options: list[str] = ()) -> list[str]:
    """The command line of one torchrun invocation (``python -m torch.distributed.run``).

    ``target`` is what torchrun runs: ``["script.py", args...]`` or ``["-m", "module", ...]``.
    With ``log_dir``, each worker's stdout and stderr go to a file of its own there.
    """
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(nnodes), "--node_rank", str(node_rank),
               "--nproc_per_node", str(nproc_per_node),
               "--master_addr", master_addr, "--master_port", str(master_port)]
    if log_dir:
        command += ["--log_dir", log_dir, "--redirects", "3"]
    return command + list(options) + list(target)


def spawn(script: str, *args: str, nprocs: int = 2, nnodes: int = 1, timeout: float = 120,
          check: bool = True) -> Launch:
    """Run ``python script NPROCS PORT``: a script that calls ``torch.multiprocessing.spawn``.

    Given the script's own arguments (``launch.spawn("multigpu.py", "50", "10")``),
    it runs ``python multigpu.py 50 10``, as given, and says the rest in the
    environment instead: ``MASTER_ADDR``, ``MASTER_PORT`` (a free port) and
    ``DDPLAB_NPROCS`` (and ``DDPLAB_NODE_RANK``, ``DDPLAB_NNODES`` with ``nnodes=2``).

    The script gets the number of processes and a free port as its two
    arguments; with ``mp.spawn`` it sets MASTER_ADDR/MASTER_PORT itself (no
    launcher does it for it). Lines its ranks print as ``[rank N] ...`` come
    back in ``rank_output[N]``.

    With ``nnodes=2`` it runs the script twice at once, as you would once on
    each of two machines: ``python script NPROCS PORT NODE_RANK NNODES`` with
    node ranks 0 and 1 and one free port; the script turns its node rank and
    local index into a global rank itself (nothing else numbers them).
    """
    _check_count(nprocs, "nprocs", "processes")
    _check_count(nnodes, "nnodes", "nodes")
    check_world_size(nprocs * nnodes)
    timeout = check_timeout(timeout, example=120)
    port = free_port(HOST)
    if args:
        env = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "DDPLAB_NPROCS": str(nprocs),
               "DDPLAB_NNODES": str(nnodes)}
        command = [sys.executable, script, *map(str, args)]
        commands = ([["env", f"DDPLAB_NODE_RANK={node}", *command] for node in range(nnodes)]
                    if nnodes > 1 else [command])
        return job.run(commands, timeout, check=check, ports=[port], env=env)
    nodes = [[str(node), str(nnodes)] for node in range(nnodes)] if nnodes > 1 else [[]]
    return job.run([[sys.executable, script, str(nprocs), str(port), *node] for node in nodes],
                   timeout, check=check, ports=[port])


def _check_count(value: object, name: str, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ddplab: {name} must be a whole number of {what}, at least 1, but got "
                          f"{value!r}. Use for example {name}=2.")
