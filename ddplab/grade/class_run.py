"""``ddplab grade``: grade submitted notebooks against the reference outputs of their check cells.

    ddplab grade submitted/ --reference notebooks/ --csv grades.csv --junit grades.xml

How a submission is graded
--------------------------
1. The reference notebook (the course's own, with solutions and outputs)
   names the exercises: each check cell has id ``check-<name>`` and tag
   ``check``; its exercise cell, just above, has id ``exercise-<name>`` and tag
   ``exercise``. Cells are found by id (by tag and source when a tool lost
   the ids), never by position, so students may add cells anywhere.
2. The submission's cells run in order in a fresh kernel, except that each
   check cell runs as the *reference's* copy. A check cell the student
   deleted is put back after its exercise and runs anyway; a deleted or
   edited check cell still scores zero on its exercise.
3. An exercise passes when its exercise cell runs without error and its
   check cell runs without error and prints what the reference printed,
   compared the way nbval compares (``ddplab/grade/nbval_sanitize.cfg`` applied to
   both sides).

Why nbclient and not ``pytest --nbval`` in a subprocess: nbval runs a
notebook in one kernel and, once a cell times out or the kernel dies, fails
every later cell. Grading must lose only the exercise that broke, so
``ddplab.grade.plan`` decides what runs and ``ddplab.grade.run`` drives the
kernel with nbclient (Jupyter's notebook executor, the one nbconvert uses),
``ddplab.grade.compare`` compares outputs with nbval's own functions (stream coalescing, the sanitize
file parser) and nbval's rules, and recovers from hangs and crashes by
replaying. ``pytest --nbval-lax`` stays the way to check a notebook by hand.

Isolation and parallelism
-------------------------
Each submission is graded in its own worker process (``_worker``) with its
own kernel; ``ddplab.start()`` in that kernel starts a lab of its own, so
submissions never share a lab. Up to ``jobs`` workers run at once
(``default_jobs``: four per core, as far as memory allows). A
worker that crashes or overruns its deadline costs only its own
submission, and is killed together with everything it started.

A submission is written by someone who wants the points. Where the machine
has bubblewrap, each worker runs in a sandbox (``ddplab.grade.sandbox``):
its own pid, mount, network and user namespaces, so it sees no other
process, no reference, no other submission and no output of the grader,
and everything it starts dies with it. Where there is no sandbox (Gradescope's
container), ``run_as`` runs each worker as a user without rights instead
(``ddplab.grade.unprivileged``). The worker is a child subreaper and
ends what it adopted; the grader plans and scores, the worker runs cells in
the kernel and runs every check cell itself against the ranks
(``ddplab.grade.witness``), where the submission's code never ran.
Every finished result is journalled (``ddplab.grade.journal``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import limits, procs
from . import sandbox, witness
from .compare import Mark, digest, sanitize_patterns, score, values_compared
from .handin import handed_in, read_text
from .journal import Journal, key, write_atomically
from .plan import GradeError, Step, check_reference, describe, load_submission, notebooks_in, plan
from .run import execute
from .unprivileged import Account, hand_over

DEFAULT_CELL_TIMEOUT = 120.0
log = logging.getLogger(__name__)


@dataclass
class Grade:
    """One submission: its marks, or the error that kept it from being graded."""
    student: str
    notebook: str
    path: str
    marks: list[Mark] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    #: Cells that are neither an exercise nor a check and did not run cleanly ("cell cell-12: error:
    #: NameError: ..."), except those tagged raises-exception. They cost no mark by
    #: themselves; an instructor reading why a check failed, and the suite proving that every
    #: section runs after a restart, read them here.
    cells_failed: list[str] = field(default_factory=list)
    #: The student's section (the folders above theirs: ``ddplab.grade.students``), "" if none.
    section: str = ""
    #: The student's other copies of this notebook, not graded, each with why ("<path> (an older copy)").
    copies: list[str] = field(default_factory=list)
    #: Cell id -> ``compare.digest`` of the outputs that cell gave in this run. The suite
    #: compares them with what a released copy keeps (tests/test_nbgrader.py): a student copy
    #: holds only outputs that a run of it (every solution a stub) gives.
    cell_digests: dict[str, str] = field(default_factory=dict)

    @property
    def score(self) -> int:
        return sum(mark.passed for mark in self.marks)


def _reference_for(path: Path, reference: Path) -> Path:
    if reference.is_file():
        return reference
    candidate = reference / path.name
    if not candidate.is_file():
        raise FileNotFoundError(f"not graded: no reference notebook named {path.name} in "
                                f"{reference}; name the reference file with --reference")
    return candidate


#: Memory one submission's run holds at its peak: its kernel, the lab's controller
#: and engine template, and a 4-rank lab (notebook 01's largest), about 1.6 GB measured.
SUBMISSION_MEMORY_BYTES = 2 * 2**30


def default_jobs(available: int | None = None, cores: int | None = None) -> int:
    """How many submissions to grade at once: four per core, as far as memory allows.

    More than one per core, because a lesson's run spends much of its time
    waiting, not computing: a ``%%rank`` cell's grace period, a deadlock
    demonstrated until its timeout, ranks meeting. Measured on 2 cores, 20
    submissions of notebook 01 (``benchmarks/bench_grade.py``, one template for
    the class): 123 s with 4 at once, 105 s with 8; the CPU it needs in all,
    about 166 s, puts the floor near 85 s.
    """
    # The grader's share, not the host's: on a class server or in a Slurm job its
    # cgroup and CPU affinity bound it (ddplab.limits), and a worker past them is
    # killed, not slowed.
    if available is None:
        available = limits.memory().available
    cores = cores or limits.cpus()
    return max(1, min(4 * cores, available // SUBMISSION_MEMORY_BYTES))


def grade(submissions: list[str | Path], reference: str | Path, jobs: int | None = None,
          cell_timeout: float = DEFAULT_CELL_TIMEOUT, progress=None,
          journal: Journal | None = None, run_as: Account | None = None,
          student_depth: int | None = None) -> list[Grade]:
    """Grade every submission (files, or folders of them) in parallel; one Grade per student and
    notebook, in order.

    ``progress``, if given, is called with each Grade as it finishes.
    ``journal``, if given, records each one as it finishes, and the
    submissions it already holds are not graded again (``--resume``).
    ``run_as``, if given (``unprivileged.account``), is the user each unsandboxed
    submission runs as. ``student_depth``: ``--student-depth`` (``ddplab.grade.students``).

    Stopped (an exception reaches it while it waits: SIGTERM made one by
    ``ddplab grade``, Ctrl-C), it ends every worker, removes their work folders,
    records nothing unfinished, and raises it on.
    """
    reference = Path(reference)
    for folder in sweep_abandoned_work():
        log.info("ddplab grade: removed %s, left by a grader that was killed", folder)
    if not reference.exists():
        raise GradeError(f"ddplab grade: the reference {reference} does not exist. Pass the "
                         f"course's notebooks folder (or one notebook) with --reference.")
    names = {p.name for p in notebooks_in([reference])}
    found = handed_in(submissions, names, student_depth) if submissions else []
    if not found:
        raise GradeError("ddplab grade: no submitted notebooks found. Name .ipynb files or folders.")
    work, checked = [], set()
    for handin in found:
        if handin.refused:
            work.append((handin, None, f"not graded: {handin.path.name} {handin.refused}"))
            continue
        try:
            ref = _reference_for(handin.path, reference)
        except FileNotFoundError as e:
            work.append((handin, None, str(e)))
            continue
        if ref not in checked:
            checked.add(ref)
            _say_unwitnessed(ref)          # an unusable reference stops everything, now
        work.append((handin, ref, ""))
    jobs = max(1, min(jobs or default_jobs(), len(work)))
    finished = journal.done() if journal is not None else {}
    stop = threading.Event()

    def one(item, env: dict) -> Grade | None:
        handin, ref, error = item
        path = handin.path
        entry = key(path, ref or path) if journal is not None and not handin.refused else ""
        if entry in finished:
            data = dict(finished[entry], marks=[Mark(**m) for m in finished[entry]["marks"]])
            result = Grade(**data)
        else:
            result = (Grade(handin.student, path.stem, str(path), error=error)
                      if ref is None else
                      _in_worker(path, ref, handin.student, cell_timeout, env, run_as, stop))
            if result is None or stop.is_set():
                return None                 # stopped: not graded, so not journalled
            if journal is not None and entry:
                journal.record(entry, result)
        result.section, result.copies = handin.section, list(handin.copies)
        if progress:
            progress(result)
        return result

    # Sandboxed, each submission's engines must be forked inside its sandbox:
    # a class template outside it would run their code with the grader's view
    # (and, run as another user, with the grader's rights).
    shared = (one_template_for_the_class() if sandbox.unavailable_reason() and run_as is None
              else contextlib.nullcontext({}))
    # A subreaper while it grades: what each sandbox leaves as it ends comes here to be reaped,
    # not to init (procs.adopting).
    with procs.adopting(), shared as template_env, ThreadPoolExecutor(max_workers=jobs) as pool:
        env = dict(os.environ, **template_env)
        running = [pool.submit(one, item, env) for item in work]
        try:
            return [future.result() for future in running]
        except BaseException:
            stop.set()                      # each worker ends; leaving the pool waits for them
            for future in running:
                future.cancel()
            raise


#: A submission's work folder in the temporary folder, and the file in it naming its grader.
WORK_PREFIX, OWNER = "ddplab-grade-", "grader"


def _me() -> str:
    import psutil
    return f"{os.getpid()} {psutil.Process().create_time()}"


def sweep_abandoned_work() -> list[Path]:
    """Remove the work folders that a grader killed mid-run left (its ``grader`` file names a
    process that is gone); those of a grader still running stay. The folders removed."""
    import psutil

    removed = []
    for folder in Path(tempfile.gettempdir()).glob(WORK_PREFIX + "*"):
        try:
            pid, started = (folder / OWNER).read_text().split()
            owner = psutil.Process(int(pid))
            if abs(owner.create_time() - float(started)) < 0.01:
                continue                            # its grader still runs
        except psutil.NoSuchProcess:
            pass                                    # its grader is gone
        except (OSError, ValueError):
            continue                                # not ours, or being made right now
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _say_unwitnessed(ref: Path) -> None:
    """Check the reference; warn of each check cell the grader cannot run itself (forgeable)."""
    _, found = check_reference(ref)
    for ex in found:
        if not witness.witnessable(ex.check.source):
            log.warning("ddplab grade: check cell %s of %s is not a call of a ddplab.check "
                        "function on names and literals, so it runs in the submission's kernel, "
                        "where a submission can forge it (docs/instructors.md, \"Grading a hostile "
                        "class\").",
                        ex.check.get("id", ex.name), ref.name)


@contextlib.contextmanager
def one_template_for_the_class():
    """One engine template for every submission's kernel; yields the environment that names it.

    Each kernel's labs fork their engines from a template that imported torch
    once (``ddplab.lab.template``). A kernel of its own would start its own
    template, one torch import (about 2 s of CPU) per submission; a class
    shares one. Safe to share: the template never runs a submission's code, so
    every engine is a fresh fork of the same untouched process, and it ends a
    kernel's engines when that kernel dies. It ends with the grading.
    """
    from ..lab import template
    if not template.enabled():
        yield {}
        return
    shared = template.Template()
    try:
        shared.wait_ready()
        yield {template.BORROW_ENV: shared.socket_path}
    finally:
        shared.stop()


# The worker's first lines. Importing nbformat imports jsonschema, which builds
# a grammar for the "iri" string format at import (seconds of CPU on a busy
# machine, per submission); notebooks never use that format, so the worker
# makes the optional import fail fast and jsonschema goes without it.
_WORKER = ("import sys; sys.modules['rfc3987_syntax'] = None; "
           "from ddplab.grade.class_run import _worker; sys.exit(_worker(sys.argv[1:]))")


def _in_worker(path: Path, ref: Path, student: str, cell_timeout: float,
               env: dict | None = None, run_as: Account | None = None,
               cancel: threading.Event | None = None) -> Grade | None:
    """Grade in a child process (sandboxed where the machine allows); a crash or overrun
    there costs only this submission. None if ``cancel`` was set first (the worker is ended,
    its work folder removed).

    The plan (which cells run) and the score are made here, in the grader; the
    worker only runs the steps. It reads them from a file it deletes before
    the submission's first cell runs (the steps hold the reference solutions
    that replays use), and it never sees the reference notebook itself.
    """
    begin = time.monotonic()
    reference, found = check_reference(ref)
    try:
        text = read_text(path)         # once, unfollowed: what is planned is what runs
        submission = load_submission(text)
    except ValueError as e:
        return Grade(student, ref.stem, str(path), error=f"not graded: {e}",
                     marks=[Mark(ex.name, False, "not graded") for ex in found])
    steps, problems = plan(submission, found, reference)
    deadline = 300 + 3 * len(reference.cells) * cell_timeout
    sandboxed = not sandbox.unavailable_reason()
    run_as = None if sandboxed else run_as
    with tempfile.TemporaryDirectory(prefix=WORK_PREFIX) as tmp:
        tmp = Path(tmp)
        (tmp / OWNER).write_text(_me())             # whose it is, for a later run's sweep
        todo, out = tmp / "steps.json", tmp / "ran.json"
        todo.write_text(json.dumps([asdict(step) for step in steps]))
        if sandboxed or run_as:
            # Its own copy of the notebook, in the one folder it may write to.
            cwd = tmp / "work"
            cwd.mkdir()
            (cwd / path.name).write_text(text, encoding="utf-8")
        else:
            # The submission's own folder is the working directory, as in nbgrader:
            # files a notebook writes land beside it, never in the course's folder.
            cwd = path.resolve().parent
            # Its temporary files go in ours, removed below however it ends (the
            # sandbox's /tmp is a tmpfs of its own): a notebook stopped mid-way
            # leaves nothing in the machine's temporary folder.
            (tmp / "tmp").mkdir()
            env = dict(env or os.environ, TMPDIR=str(tmp / "tmp"))
        command = [sys.executable, "-c", _WORKER, str(todo), str(out), str(cwd), str(cell_timeout)]
        if run_as:
            # Its home in the work folder too (the user's own may not exist), and only
            # the variables a sandboxed worker would get: the grader's are not its.
            (tmp / "home").mkdir()
            (tmp / "tmp").mkdir()
            env = dict(sandbox.environment(env or os.environ), HOME=str(tmp / "home"),
                       TMPDIR=str(tmp / "tmp"))
            hand_over(tmp, run_as)
        if sandboxed:
            command, env = sandbox.wrap(command, scratch=tmp), sandbox.environment(env or os.environ)
        # In our session, not one of its own: a terminal's Ctrl-C reaches the
        # worker too, and it stops (a worker in a session of its own would go
        # on grading while the pool waits for it). Its stdout is discarded; its
        # last stderr line is the message. Not noting its descendants while it
        # runs keeps a long grading from reading the process table ten times a
        # second; at the end, those it still has are ended with it.
        worker = procs.Group([command], env=env, output="stderr", session=False, note=False,
                             user=(run_as.uid, run_as.gid) if run_as else None,
                             cwd=str(tmp) if run_as else None)    # the grader's may be shut to it
        ran = worker.start().wait(timeout=deadline, grace=5, cancel=cancel)
        # bubblewrap's own child, adopted by the grader as the sandbox ends: no zombie left
        procs.reap_adopted(settle=1.0 if sandboxed else 0.0)
        if ran.stopped == "cancelled":
            return None
        if ran.timed_out:
            return Grade(student, ref.stem, str(path),
                         error=f"not graded: grading took longer than {deadline:g} s and was stopped")
        killed = killed_reason(ran[0].returncode, sandboxed) if not ran[0].ended else ""
        if killed:
            return Grade(student, ref.stem, str(path), error=killed)
        if ran[0].returncode != 0 or not out.exists():
            last = (ran[0].output.strip().splitlines() or ["no message"])[-1]
            return Grade(student, ref.stem, str(path),
                         error=f"not graded: the grader failed ({last[:150]})")
        for step, record in zip(steps, json.loads(out.read_text())):
            step.status, step.error, step.outputs = record["status"], record["error"], record["outputs"]
            step.seconds = record.get("seconds", 0.0)
    patterns = sanitize_patterns()
    marks = score(steps, found, problems, patterns)
    failed = [f"{describe(step)}: {step.status}: {step.error}" for step in steps
              if step.role == "other" and step.status != "ok"]
    cells = {cell.get("id"): cell for cell in submission.cells if cell.get("id")}
    digests = {step.cell_id: digest(step.outputs, patterns, values_compared(cells[step.cell_id]))
               for step in steps if step.cell_id in cells}
    return Grade(student, ref.stem, str(path), marks=marks, seconds=time.monotonic() - begin,
                 cells_failed=failed, cell_digests=digests)


def killed_reason(returncode: int | None, sandboxed: bool) -> str:
    """The reason for a grading worker that a signal ended ("" if it exited by itself, or a
    terminal's Ctrl-C, SIGINT, reached it: the grader stops then too).

    Not the worker's last stderr line: it had no chance to say anything, and that line is
    whatever its kernel logged last (a start-up warning), which reads as the cause. Its
    own kernel's code is what reaches it (a submission that kills its ancestors); the
    grader ends a worker only at the deadline, reported apart. bubblewrap reports a
    child a signal ended as 128 + the signal's number.
    """
    number = (-returncode if returncode is not None and returncode < 0 else
              returncode - 128 if sandboxed and returncode is not None and 128 < returncode < 160
              else None)
    if number is None or number == signal.SIGINT:
        return ""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return (f"not graded: the submission killed its grader: the grading worker that runs its "
            f"kernel was ended by {name} while the notebook ran, which a notebook does when its "
            f"code signals its kernel's parent processes (os.getppid()) or others it did not "
            f"start. Such code cannot be graded. (If the notebook does no such thing, the machine "
            f"ran out of memory: see dmesg.)")


def _worker(argv: list[str]) -> int:
    """Run the steps in ``argv[0]`` (then deleted) in a kernel; write what each did to ``argv[1]``.

    A child subreaper: whatever the submission detaches is adopted here and
    ended before the results are written, so nothing of it outlives its slot
    or can touch the results file afterwards.
    """
    todo, out, cwd, cell_timeout = argv
    procs.become_subreaper()
    procs.hide_memory()
    witness.prepare()          # before any cell of the submission: see its docstring
    steps = [Step(**record) for record in json.loads(Path(todo).read_text())]
    Path(todo).unlink()
    try:
        execute(steps, cwd, float(cell_timeout), witnessed=True)
    finally:
        procs.end_descendants(grace=1)
    write_atomically(out, json.dumps([{"status": s.status, "error": s.error, "outputs": s.outputs,
                                       "seconds": s.seconds} for s in steps]))
    return 0
