"""The one runner of launched jobs, and what a job did: ``run`` and ``Launch``.

Every job ddplab launches as subprocesses that make their own process group runs here:
``launch.torchrun`` and ``launch.spawn`` (a notebook's scripts), ``train.torchrun`` and
``train.run_commands`` (the DDP trainer launched three ways). ``run`` starts the commands
as one ``ddplab.procs.Group`` and waits; whatever happens, every process they started is
ended when it returns. A failed job raises ``LaunchError`` with one report
(``ddplab.launch.failure``); ``check=False`` returns the ``Launch`` instead.

- Each command leads a session of its own (ending it ends the children that stay in it,
  mp.spawn's, never the kernel); torchrun's workers lead sessions of their own, and the
  group notes them while it waits.
- ``timeout`` is a no-progress one: a job that prints or computes runs on; one whose
  processes neither print nor use the CPU for ``timeout`` s is stuck; so is one whose rank
  sat a whole ``timeout`` in one torch.distributed call, whatever the others do (the notes
  ``ddplab.launch.hook`` leaves).
- The commands' environment is this process's, less the variables only a launcher decides
  (``RANK``, ``MASTER_PORT``, ...: a table then shows what it set), with the hook on
  ``PYTHONPATH``, ``TMPDIR`` a folder that goes with the job, gloo on the loopback, Python
  unbuffered, and ``env`` on top.
- Output: each command's own (``Launch.outputs``), all of it as the launchers'
  (``launcher_output``), and by rank: torchrun's per-worker files (``--log-dir``, when the
  command names ``{dir}``) or the lines a rank prints as ``[rank N] ...``. The job's folder
  and its ports read ``<dir>`` and ``PORT``, so shown output is the same on every run.

Which to use from a notebook: code in a file that starts its own processes (torchrun,
``mp.spawn``) goes through ``ddplab.launch``; a function or a script that should run on the
lab's own ranks (its engines; output by rank in the notebook, globals kept) goes through
``lab.spawn`` or ``lab.run_script``, whose failures read the same (``ddplab.lab.verdicts``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import procs
from ..env import TORCHRUN_VARIABLES
from ..errors import LaunchError
from ..text import replace_tracebacks
from . import failure, hook

#: The variables a launcher may set for each rank, in the order tables show them.
ENV_NAMES = tuple(name for name in TORCHRUN_VARIABLES if name != "GROUP_WORLD_SIZE")
#: Where a launched process finds the job's folder (``report_env`` writes its report there).
REPORT_DIR = "DDPLAB_LAUNCH_DIR"
#: After one command fails, how long the others get to exit by themselves (their own error is
#: often the real cause) before they are ended (``procs.END_GRACE_S`` after SIGTERM).
SETTLE_S = 5.0
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
    #: Each command's own output, cleaned, in the order of ``commands``.
    outputs: list[str] = field(default_factory=list)

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


def run(commands: list[list[str]], timeout: float, *, check: bool = True, ports: list[int] = (),
        torchrun_nproc: int | None = None, env: dict[str, str] | None = None,
        settle: float = SETTLE_S) -> Launch:
    """Run ``commands`` side by side as one job and wait; see the module docstring.

    ``{dir}`` in a command is the job's folder (torchrun's ``--log-dir`` goes there);
    ``ports``: numbers to show as ``PORT``; ``torchrun_nproc``: the commands are torchrun's,
    with that many workers each, whose output is read by rank from their log files;
    ``settle``: seconds the others get after one fails (0: end them at once).
    """
    folder = tempfile.mkdtemp(prefix="ddplab_launch-")     # mode 0700
    try:
        commands = [[word.replace("{dir}", folder) for word in cmd] for cmd in commands]
        given, env = env or {}, {k: v for k, v in os.environ.items()
                                 # Only the launcher decides these, so a table shows what it set.
                                 if k not in TORCHRUN_VARIABLES and k != "TORCHELASTIC_USE_AGENT_STORE"}
        sitecustomize = hook.install(folder)
        os.mkdir(tmp := os.path.join(folder, "tmp"))  # mp.spawn's error files, torchrun's logs: gone with it
        env.update({REPORT_DIR: folder, "TMPDIR": tmp, "GLOO_SOCKET_IFNAME": "lo",
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [sitecustomize,
                                                                env.get("PYTHONPATH")]))},
                   **given)
        waited: dict[int, str] = {}
        ran = procs.Group(commands, env=env).start().wait(
            timeout, settle=settle, progress=True,
            stuck=lambda: bool(waited.update(hook.waited(folder, timeout)) or waited))
        clean = _cleaner(folder, list(ports))
        ended = f"ddplab ended this launcher with SIGTERM: {failure.why_ended(ran, timeout)} " \
                f"(torch's traceback for it left out)"
        outputs = [clean(replace_tracebacks(done.output, _SIGNALLED, ended) if done.ended
                         else done.output) for done in ran]
        launcher, attempts = "\n".join(outputs), 1
        if torchrun_nproc is None:
            rank_output = rank_lines(launcher)
        else:
            rank_output, attempts = _torchrun_logs(folder, len(commands), torchrun_nproc, clean)
        formed = hook.formed(folder)
        reports = {}
        for path in glob.glob(os.path.join(folder, "report-*.json")):
            with open(path) as f:
                report = json.load(f)
            rank = report.get("dist.get_rank()", report.get("RANK"))
            reports[int(rank) if rank is not None else len(reports)] = report
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = Launch([[clean(word) for word in cmd] for cmd in commands], ran.returncodes,
                    ran.timed_out, launcher, rank_output, dict(sorted(reports.items())), attempts,
                    formed, waited, outputs)
    if check and not result.ok:
        raise LaunchError(failure.message(result, timeout), result)
    return result


def _cleaner(folder: str, ports: list[int]) -> Callable[[str], str]:
    def clean(text: str) -> str:
        text = text.replace(folder, "<dir>")
        for port in ports:
            text = re.sub(rf"(?<!\d){port}(?!\d)", "PORT", text)
        return text
    return clean


def rank_lines(text: str) -> dict[int, str]:
    """Lines printed as ``[rank N] ...``, grouped by N, each rank's lines in their order.

    Unbuffered ``print`` writes the text and its newline in two calls, so two
    ranks printing at once can produce ``[rank 0] a[rank 1] b\\n\\n``: a line
    therefore ends at a newline or at the next ``[rank N]`` mark.
    """
    out: dict[int, list[str]] = {}
    marks = list(_RANK_MARK.finditer(text))
    for mark, after in zip(marks, marks[1:] + [None]):
        end = after.start() if after is not None else len(text)
        line = text[mark.end():end].split("\n", 1)[0]
        out.setdefault(int(mark.group(1)), []).append(line)
    return {rank: "\n".join(lines) + "\n" for rank, lines in sorted(out.items())}


def _torchrun_logs(folder: str, nnodes: int, nproc: int,
                   clean: Callable[[str], str]) -> tuple[dict[int, str], int]:
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
