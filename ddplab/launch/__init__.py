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
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import procs
from ..env import TORCHRUN_VARIABLES, check_timeout, check_world_size, free_port
from ..errors import ConfigError, LaunchError
from ..text import replace_tracebacks
from . import hook as launched
from .failure import (
    command_line as command_line,  # public: a launch as you would type it
    message as failure_message,
)

HOST = "127.0.0.1"
#: The variables a launcher may set for each rank, in the order tables show them.
ENV_NAMES = tuple(name for name in TORCHRUN_VARIABLES if name != "GROUP_WORLD_SIZE")
_REPORT_DIR = "DDPLAB_LAUNCH_DIR"
# After one command fails, the others get this long to exit by themselves (their own error
# is often the real cause) before they are ended (``procs.END_GRACE_S`` after SIGTERM).
_SETTLE_S = 5.0
# torchrun's agent raises this on the SIGTERM that ends it: when ddplab sent it, one line instead.
_SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException:"
_RANK_MARK = re.compile(r"\[rank (\d+)\] ?")


@dataclass
class Launch:
    """What a launch did: its commands, how they ended, and each rank's output."""
    commands: list[list[str]]
    returncodes: list[int | None]          # None: ended by ddplab (timeout, or another failed)
    timed_out: bool
    launcher_output: str                   # the launchers' own stdout and stderr, cleaned
    rank_output: dict[int, str] = field(default_factory=dict)
    reports: dict[int, dict] = field(default_factory=dict)
    attempts: int = 1                      # torchrun: how many times the workers were started
    groups_formed: int | None = None       # processes that formed a process group (None: unknown)
    #: Ranks that sat a whole timeout in one torch.distributed call, and where ("in all_reduce
    #: (train.py line 9)"): the launch was ended for them, whatever the others did.
    waited: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def output_by_rank(self) -> str:
        """Each rank's output under a ``[rank N]`` label, rank 0 first."""
        return "\n".join(f"[rank {rank}]\n{text.rstrip()}"
                         for rank, text in sorted(self.rank_output.items())).rstrip()

    def env_table(self, names: tuple[str, ...] = ENV_NAMES) -> str:
        """The variables each rank reported with ``report_env()``, as a text table."""
        return env_table(self.reports, names)

    def __repr__(self) -> str:
        state = ("ok" if self.ok else "timed out" if self.timed_out
                 else f"failed (exit codes {self.returncodes})")
        if self.ok and self.groups_formed == 0:
            state = ("exited 0 but no process formed a process group (never called "
                     "init_process_group: a GPU-only script on a machine without GPUs?)")
        if self.attempts > 1:
            state += f", {self.attempts} attempts"
        return f"<ddplab.launch.Launch: {len(self.commands)} command(s), {state}, " \
               f"{len(self.reports)} rank(s) reported>"


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
    folder = os.environ.get(_REPORT_DIR)
    if folder:
        key = report.get("dist.get_rank()", report["RANK"] or os.getpid())
        path = os.path.join(folder, f"report-{key}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)    # whole or absent, never half-written
    return report


def env_table(reports: dict[int, dict] | list[dict], names: tuple[str, ...] = ENV_NAMES) -> str:
    """Reports by rank as a text table: one row per variable, one column per rank.

    Unset variables show as ``-``; a MASTER_PORT number shows as ``PORT``
    (it is a free port, different on every run).
    """
    if isinstance(reports, list):
        reports = dict(enumerate(reports))
    ranks = sorted(reports)
    extra = [k for r in ranks for k in reports[r] if k not in names]
    rows = list(names) + list(dict.fromkeys(extra))

    def cell(value, name):
        if value is None:
            return "-"
        if name == "MASTER_PORT" and str(value).isdigit():
            return "PORT"
        return str(value)

    table = [["variable"] + [f"rank {r}" for r in ranks]]
    table += [[name] + [cell(reports[r].get(name), name) for r in ranks] for name in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


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
    return _run(commands, [port], timeout, check, torchrun_nproc=nproc_per_node)


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
        return _run(commands, [port], timeout, check, env=env)
    nodes = [[str(node), str(nnodes)] for node in range(nnodes)] if nnodes > 1 else [[]]
    return _run([[sys.executable, script, str(nprocs), str(port), *node] for node in nodes],
                [port], timeout, check)


def _check_count(value: object, name: str, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ddplab: {name} must be a whole number of {what}, at least 1, but got "
                          f"{value!r}. Use for example {name}=2.")


# ----------------------------------------------------------------- the runner
# What the launched processes run first, and what they leave: ``launch.hook``; the message of
# a failed launch, and a launch's command line: ``launch.failure``.
def _run(commands: list[list[str]], ports: list[int], timeout: float, check: bool,
         torchrun_nproc: int | None = None, env: dict[str, str] | None = None) -> Launch:
    folder = tempfile.mkdtemp(prefix="ddplab_launch-")     # mode 0700
    try:
        commands = [[word.replace("{dir}", folder) for word in cmd] for cmd in commands]
        given, env = env or {}, {k: v for k, v in os.environ.items()
                                 # Only the launcher decides these, so a table shows what it set.
                                 if k not in TORCHRUN_VARIABLES and k != "TORCHELASTIC_USE_AGENT_STORE"}
        hook = launched.install(folder)
        os.mkdir(tmp := os.path.join(folder, "tmp"))  # mp.spawn's error files, torchrun's logs: gone with it
        env.update({_REPORT_DIR: folder, "TMPDIR": tmp, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")]))},
                   **given)
        # Each launcher leads a session of its own: ending it ends the children that stay in it
        # (mp.spawn's), never the kernel. torchrun's workers lead sessions of their own; the
        # group notes them while it waits.
        waited: dict[int, str] = {}
        ran = procs.Group(commands, env=env).start().wait(
            timeout, settle=_SETTLE_S, progress=True,
            stuck=lambda: bool(waited.update(launched.waited(folder, timeout)) or waited))
        clean = _cleaner(folder, ports)
        why = (f"a rank waited in one torch.distributed call for timeout={timeout:g} s"
               if ran.stopped == "stuck" else f"no progress for timeout={timeout:g} s"
               if ran.timed_out else "another launcher failed")
        ended = f"ddplab ended this launcher with SIGTERM: {why} (torch's traceback for it left out)"
        launcher = "\n".join(clean(replace_tracebacks(done.output, _SIGNALLED, ended)
                                   if done.ended else done.output) for done in ran)
        attempts = 1
        if torchrun_nproc is None:
            rank_output = _rank_lines(launcher)
        else:
            rank_output, attempts = _torchrun_logs(folder, len(commands), torchrun_nproc, clean)
        formed = launched.formed(folder)
        reports = {}
        for path in glob.glob(os.path.join(folder, "report-*.json")):
            with open(path) as f:
                report = json.load(f)
            rank = report.get("dist.get_rank()", report.get("RANK"))
            reports[int(rank) if rank is not None else len(reports)] = report
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = Launch(commands, ran.returncodes, ran.timed_out, launcher, rank_output,
                    dict(sorted(reports.items())), attempts, formed, waited)
    result.commands = [[clean(word) for word in cmd] for cmd in commands]
    if check and not result.ok:
        raise LaunchError(failure_message(result, timeout), result)
    return result


def _cleaner(folder: str, ports: list[int]):
    def clean(text: str) -> str:
        text = text.replace(folder, "<dir>")
        for port in ports:
            text = re.sub(rf"(?<!\d){port}(?!\d)", "PORT", text)
        return text
    return clean


def _rank_lines(text: str) -> dict[int, str]:
    """Lines printed as ``[rank N] ...``, grouped by N, each rank's lines in their order.

    Unbuffered ``print`` writes the text and its newline in two calls, so two
    ranks printing at once can produce ``[rank 0] a[rank 1] b\n\n``: a line
    therefore ends at a newline or at the next ``[rank N]`` mark.
    """
    out: dict[int, list[str]] = {}
    marks = list(_RANK_MARK.finditer(text))
    for mark, after in zip(marks, marks[1:] + [None]):
        end = after.start() if after is not None else len(text)
        line = text[mark.end():end].split("\n", 1)[0]
        out.setdefault(int(mark.group(1)), []).append(line)
    return {rank: "\n".join(lines) + "\n" for rank, lines in sorted(out.items())}


def _torchrun_logs(folder: str, nnodes: int, nproc: int, clean) -> tuple[dict[int, str], int]:
    """torchrun's per-worker files (``<log_dir>/<run>/attempt_<k>/<local_rank>/``), by global
    rank, and the number of attempts. After a restart every attempt is kept, each under an
    ``[attempt K]`` line: the first attempt's error is usually why there was a second."""
    out, attempts = {}, 1
    for node in range(nnodes):
        for local in range(nproc):
            found = sorted(glob.glob(os.path.join(folder, f"logs-node{node}", "*", "attempt_*",
                                                  str(local))),
                           key=lambda d: int(os.path.basename(os.path.dirname(d))[8:]))
            if not found:
                continue
            attempts = max(attempts, len(found))
            parts = []
            for k, where in enumerate(found):
                paths = [os.path.join(where, stream) for stream in ("stdout.log", "stderr.log")]
                text = "".join(Path(path).read_text() for path in paths if os.path.exists(path))
                parts.append(text if len(found) == 1 else f"[attempt {k}]\n{text}")
            out[node * nproc + local] = clean("".join(parts))
    return dict(sorted(out.items())), attempts

