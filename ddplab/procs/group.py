"""A set of commands run as one job, one per rank: ``Group``, torch elastic's ``PContext`` in small.

    group = procs.Group(commands, env=env).start()     # one command per rank, 0, 1, ...
    ran = group.wait(timeout=120, settle=5)            # every process is gone when it returns
    ran.ok, ran.timed_out, ran.returncodes, ran[0].output

``ddplab.launch`` (torchrun, mp.spawn scripts), ``ddplab.train.run_commands``,
``ddplab grade``'s workers and the engine template all run their commands
through it, so one set of rules holds for all of them:

- Start: each command by ``procs.start``, in a session of its own unless
  ``session=False``; stdin is /dev/null.
- Output, by rank: each command's output goes to an unnamed temporary file of
  its own, never a pipe (a command that writes more than a pipe holds, while
  nobody reads, would stop). ``output`` picks what goes there: ``"all"``
  (stdout and stderr, interleaved as written), ``"stdout"`` (stderr stays
  ours) or ``"stderr"`` (stdout is discarded). ``on_line(rank, line)`` is
  called with each line as it arrives, while the group waits; ``Exit.output``
  holds it all once the group is closed. Nothing is left on disk, even if this
  process is killed: the files have no name.
- Wait: ``wait(timeout, settle)`` returns when every command has exited; or
  ``settle`` seconds after the first one failed (the others get that long to
  exit by themselves, so that their own error message, often the real
  cause, is kept; ``settle=0`` stops at once); or at ``timeout``. With
  ``progress=True`` the timeout is a *no-progress* one: at each expiry the
  wait goes on while the job made progress in that window (a command wrote
  output, or the tree used ``BUSY_SHARE`` of a core), so a long healthy job
  is never cut; ``limit`` caps the whole wait if asked, and ``stuck`` (the
  caller's judgement, asked at each expiry the job made progress) may end it
  all the same. ``Results.stopped`` says which ended it.
- End: ``close(grace)`` ends the whole tree by ``Tree.end`` (SIGTERM, ``grace``
  seconds, SIGKILL), every session the commands lead included, and the
  descendants noted while waiting (torchrun's workers lead sessions of their
  own). ``wait`` closes the group whatever happens, Ctrl-C included, and so
  does leaving a ``with`` block.
- Results, by rank: ``Results[rank]`` is an ``Exit``: the command, its exit
  code (``-N``: ended by signal N), whether the group ended it, and its output.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .tree import BUSY_SHARE, END_GRACE_S, Tree, cpu_times, cpu_used, start

log = logging.getLogger(__name__)

#: What ``Group(output=...)`` keeps: (stdout, stderr) for ``Popen``; FILE is the rank's file.
_FILE = object()
OUTPUTS = {"all": (_FILE, subprocess.STDOUT), "stdout": (_FILE, None),
           "stderr": (subprocess.DEVNULL, _FILE)}
#: How often a waiting group looks at its commands (and reads their output for ``on_line``).
POLL_S = 0.1


@dataclass
class Exit:
    """How one rank's command ended."""
    rank: int
    command: list[str]
    returncode: int | None     # 0, an exit status, or -N: ended by signal N (None: never reaped)
    ended: bool                # it still ran when the wait stopped: the group ended it
    output: str = ""

    @property
    def signal(self) -> int | None:
        """The signal that ended it, if one did."""
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    @property
    def failed(self) -> bool:
        """It exited by itself, with an error (a rank the group ended did not fail by itself)."""
        return not self.ended and self.returncode != 0


@dataclass
class Results:
    """What a group's commands did, by rank (``results[rank]``)."""
    exits: dict[int, Exit] = field(default_factory=dict)
    timed_out: bool = False
    #: Why the wait stopped before every command ended by itself: ``"timeout"`` (a plain
    #: timeout), ``"stalled"`` (no progress for a whole timeout), ``"limit"``, ``"cancelled"``,
    #: ``"stuck"`` (``wait``'s ``stuck`` said so); "" otherwise.
    stopped: str = ""

    def __getitem__(self, rank: int) -> Exit:
        return self.exits[rank]

    def __iter__(self) -> Iterator[Exit]:
        return iter(self.exits[rank] for rank in sorted(self.exits))

    def __len__(self) -> int:
        return len(self.exits)

    @property
    def ok(self) -> bool:
        """Every command exited by itself with 0, in time."""
        return not self.timed_out and all(e.returncode == 0 and not e.ended for e in self)

    @property
    def returncodes(self) -> list[int | None]:
        """Exit codes by rank; None for a command the group ended (time ran out, or another failed)."""
        return [None if e.ended else e.returncode for e in self]

    @property
    def failures(self) -> dict[int, Exit]:
        """The ranks whose command failed by itself."""
        return {e.rank: e for e in self if e.failed}


class Group:
    """Commands started together, watched together and ended together, one per rank.

    ``env``, ``cwd``: for every command. ``session``: each in a session of its
    own (``procs.start``). ``note``: note the commands' descendants while
    waiting, so that those which leave the tree (torchrun's workers, a daemon)
    are ended too; it reads the process table, so a long quiet wait (a grading
    worker) turns it off and is ended with the descendants it has at the end.
    ``user``: ``(uid, gid)`` the commands run as (that group and no other), where
    this process is root; ``ddplab grade --run-as`` runs a submission so.
    """

    def __init__(self, commands: list[list[str]], *, env: dict | None = None,
                 cwd: str | None = None, output: str = "all",
                 on_line: Callable[[int, str], None] | None = None,
                 session: bool = True, note: bool = True, user: tuple[int, int] | None = None) -> None:
        if output not in OUTPUTS:
            raise ValueError(f"ddplab: output must be one of {sorted(OUTPUTS)}, not {output!r}.")
        self.commands = [list(c) for c in commands]
        self.processes: list[subprocess.Popen] = []
        self._options = {"env": env, "cwd": cwd}
        if user is not None:
            uid, gid = user
            self._options.update(user=uid, group=gid, extra_groups=[])
        self._output, self._on_line = output, on_line
        self._session, self._note = session, note
        self._tree = Tree()
        self._files: list = []                 # one unnamed file per rank
        self._read: list[int] = []             # bytes of each file read so far
        self._chunks: list[list[bytes]] = []
        self._partial: list[bytes] = []        # the start of a line not yet ended, per rank
        self._timed_out = False
        self._stopped = ""
        self._results: Results | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> Group:
        """Start every command, rank 0 first; if one cannot start, end those that did, and raise."""
        try:
            for command in self.commands:
                self._files.append(tempfile.TemporaryFile(prefix="ddplab-out-"))
                self._read.append(0)
                self._chunks.append([])
                self._partial.append(b"")
                out, err = (self._files[-1] if s is _FILE else s for s in OUTPUTS[self._output])
                self.processes.append(start(command, session=self._session, stdout=out,
                                            stderr=err, **self._options))
                self._tree.add(self.processes[-1], session=self._session)
        except BaseException:
            self.close(grace=0)
            raise
        return self

    def __enter__(self) -> Group:
        return self.start() if not self.processes else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ watch
    def poll(self) -> list[int | None]:
        """Each command's exit code, None while it runs; notes descendants, reads new output."""
        codes = [p.poll() for p in self.processes]
        if self._note:
            self._tree.note()
        if self._on_line is not None:
            for rank in range(len(self.processes)):
                self._pump(rank)
        return codes

    def wait(self, timeout: float | None, settle: float = 0.0,
             grace: float = END_GRACE_S, *, progress: bool = False,
             limit: float | None = None, cancel: threading.Event | None = None,
             stuck: Callable[[], bool] | None = None) -> Results:
        """Wait as the module docstring says, then ``close(grace)``; the results by rank.

        ``progress``: ``timeout`` ends the wait only after a whole timeout without progress
        (no output from any command, less than ``BUSY_SHARE`` of a core used by the tree);
        ``limit``: seconds after which the wait ends whatever the job does (None: never);
        ``cancel``: once set (by another thread: a grader told to stop), the wait ends and the
        tree is ended, as at a timeout (``Results.stopped`` is ``"cancelled"``);
        ``stuck``: asked at each expiry at which the job made progress; True ends the wait as
        ``"stuck"`` all the same (a launch one of whose ranks waited a whole timeout in one
        call, while another computes).
        """
        begin = time.monotonic()
        deadline = None if timeout is None else begin + timeout
        cap = None if limit is None else begin + limit
        failed_at, seen = None, self._activity() if progress else None
        try:
            while True:
                codes = self.poll()
                if all(code is not None for code in codes):
                    break
                now = time.monotonic()
                if failed_at is None and any(code not in (None, 0) for code in codes):
                    failed_at = now
                if failed_at is not None and now - failed_at >= settle:
                    break
                if cap is not None and now >= cap:
                    self._timed_out, self._stopped = True, "limit"
                    break
                if cancel is not None and cancel.is_set():
                    self._stopped = "cancelled"
                    break
                if deadline is not None and now >= deadline:
                    if seen is not None:
                        now_seen = self._activity()
                        if self._progressed(seen, now_seen, timeout):
                            if stuck is not None and stuck():
                                self._timed_out, self._stopped = True, "stuck"
                                break
                            seen, deadline = now_seen, now + timeout
                            continue
                    self._timed_out = True
                    self._stopped = "stalled" if progress else "timeout"
                    break
                time.sleep(POLL_S)
        finally:
            results = self.close(grace)
        return results

    def _activity(self) -> tuple[int, dict[int, float]]:
        """What the job has done so far: bytes its commands wrote, CPU seconds by process."""
        written = 0
        for file in self._files:
            written += os.fstat(file.fileno()).st_size
        if self._note:
            self._tree.note()
        return written, cpu_times(self._tree.members)

    @staticmethod
    def _progressed(before: tuple[int, dict[int, float]], after: tuple[int, dict[int, float]],
                    window: float) -> bool:
        """Whether the job made progress between two ``_activity`` readings ``window`` apart:
        it wrote, used the CPU, or one of its processes ended (a job winding down: torchrun's
        workers done, its agent closing)."""
        wrote, used = after[0] > before[0], cpu_used(before[1], after[1])
        ended = bool(set(before[1]) - set(after[1]))
        if wrote or ended or used >= BUSY_SHARE * window:
            log.debug("ddplab: the job is still working at its timeout (output: %s, a process "
                      "ended: %s, CPU %.2f s in %.3g s): waiting on", wrote, ended, used, window)
            return True
        return False

    def wait_for_line(self, rank: int, line: str, timeout: float | None = None) -> bool:
        """Wait until rank ``rank`` has printed ``line`` as a whole line.

        False if it exited without, or ``timeout`` ran out first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            running = self.processes[rank].poll() is None
            self._pump(rank)
            if line in (whole.strip() for whole in self._lines(rank)):
                return True
            if not running or (deadline is not None and time.monotonic() >= deadline):
                return False
            time.sleep(0.02)       # a file has no readline that waits: look again soon

    def output(self, rank: int) -> str:
        """What rank ``rank`` has written so far (as far as read)."""
        return b"".join(self._chunks[rank]).decode(errors="replace")

    # -------------------------------------------------------------------- end
    def close(self, grace: float = END_GRACE_S) -> Results:
        """End the whole tree (``Tree.end``), reap every command, read their output; the results.

        Calling it again returns the same results.
        """
        if self._results is not None:
            return self._results
        ended = [p.poll() is None for p in self.processes]
        try:
            self._tree.note()
            left = self._tree.end(grace=grace)
            if left:
                log.warning("ddplab: processes %s outlived their ending", [p.pid for p in left])
        finally:
            for process in self.processes:
                process.wait()
            try:
                for rank in range(len(self._files)):
                    self._pump(rank, final=True)
            finally:
                for file in self._files:
                    file.close()
        self._results = Results({rank: Exit(rank, self.commands[rank], p.returncode, ended[rank],
                                            self.output(rank))
                                 for rank, p in enumerate(self.processes)}, self._timed_out,
                                self._stopped)
        return self._results

    # ---------------------------------------------------------------- output
    def _pump(self, rank: int, final: bool = False) -> None:
        """Read what rank ``rank`` wrote since last time; hand whole lines to ``on_line``.

        ``os.pread`` leaves the file's offset alone: the command (and its
        children) write through the same open file, at that offset.
        """
        fd = self._files[rank].fileno()
        while True:
            data = os.pread(fd, 1 << 16, self._read[rank])
            if not data:
                break
            self._read[rank] += len(data)
            self._chunks[rank].append(data)
            if self._on_line is not None:
                *lines, self._partial[rank] = (self._partial[rank] + data).split(b"\n")
                for line in lines:
                    self._emit(rank, line)
        if final and self._on_line is not None and self._partial[rank]:
            self._emit(rank, self._partial[rank])
            self._partial[rank] = b""

    def _emit(self, rank: int, line: bytes) -> None:
        # Not guarded: an error in on_line is the caller's bug, and raises out of
        # ``wait``, which still ends every process first.
        self._on_line(rank, line.decode(errors="replace"))

    def _lines(self, rank: int) -> list[str]:
        text = self.output(rank)
        return text[:text.rfind("\n") + 1].splitlines()


def run(commands: list[list[str]], timeout: float | None, *, settle: float = 0.0,
        grace: float = END_GRACE_S, **options) -> Results:
    """Start ``commands`` as a ``Group(commands, **options)``, wait, end them all; the results."""
    return Group(commands, **options).start().wait(timeout, settle=settle, grace=grace)
