"""Run one submission's cells in a kernel of its own, and survive what students write.

``ddplab.grade.cells`` turns a submission into a list of ``CellRun``s (the student's
cells, with the reference check cells in place of the student's copies);
``execute`` runs them one by one in a fresh Jupyter kernel through nbclient,
nbval's own executor library, and records each cell's status and outputs.

What can go wrong in a cell, and what happens:

- it raises (also ``RankError`` from a rank): recorded; the next cell runs.
- a deadlock on the ranks: ddplab's ``HangError`` after the lab's timeout;
  the lab is then broken, so the kernel is recovered (below).
- it runs past the per-cell timeout (an infinite loop): the kernel is killed
  and recovered.
- the kernel dies (a crash, ``os._exit``), or an engine dies: recovered.
- it tries to forge a check (replaces a checker, patches ``Lab.run``,
  ``print`` or ``exec``, prints a ``Correct`` line): a grading worker runs
  every check cell that calls ``ddplab.check`` in its own process
  (``ddplab.grade.witness``); any other check cell runs through
  ``ddplab.grade.guard``'s guard in the kernel and earns the point
  only by its verdict (forgeable: the grader says so).

Recovering means: kill the kernel (its lab's engines and controller exit with
it, see ``ddplab.rank.tether``), start a new one, and replay the cells before the
failure, with the reference solution in place of every exercise already
failed, so the exercises after it are graded on a correct state. A cell
that fails during the replay is not graded again; if the replay itself
cannot finish, the remaining cells are marked not run.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time

import nbformat

from .. import procs
from . import witness
from .cells import CellRun, describe
from .guard import SAVE_STREAMS, guarded_check, verdict

log = logging.getLogger(__name__)
# Asked after a cell failed: is the lab this kernel started still usable?
PROBE = """\
def _ddplab_grade_probe():
    import ddplab.lab.current_lab as current_lab
    lab = current_lab.current_or_none()
    return "ok" if lab is None or not lab.running or lab.healthy else "broken"
print("ddplab-probe:", _ddplab_grade_probe())
del _ddplab_grade_probe"""


#: The exception every ``ddplab.check`` checker fails with (``ddplab.check.Feedback``), by name:
#: its message is what the student saw in the notebook, kept whole for every export.
FEEDBACK = "Feedback"


def reason(ename: str, evalue: str) -> str:
    """The reason from an error: a check's ``Feedback`` whole (headline, table, hint: the notebook's
    text), else one line (for a RankError, what the rank raised)."""
    if ename == FEEDBACK:
        return evalue.strip()
    lines = [line.strip() for line in evalue.strip().splitlines() if line.strip()]
    if ename == "RankError":
        blocks = re.split(r"^--- rank (\d+) ---$", evalue, flags=re.M)
        if len(blocks) >= 3:
            tail = [line.strip() for line in blocks[2].split("\nMeanwhile:")[0].splitlines()
                    if line.strip()]
            return _short(f"rank {blocks[1]} raised {tail[-1] if tail else 'an error'}")
    if ename == "HangError":
        stuck = [line for line in lines[1:] if line.startswith("rank ") and "still" in line]
        what = ("no rank waited for another: each was still in its own code at the lab's timeout "
                "(an endless loop, or slow work)" if "no rank is waiting for another" in lines[0]
                else "a deadlock (ranks waited for each other past the lab's timeout)")
        return _short(f"HangError: {what}" + (f"; {stuck[0]}" if stuck else ""))
    return _short(f"{ename}: {lines[0]}" if lines else ename)


#: The most one cell's outputs may weigh in a graded run (the course's largest, a timeline
#: picture, is about 100 kB).
MAX_CELL_OUTPUT_BYTES = 16 * 2**20


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Kernel:
    """One Jupyter kernel driven through nbclient; ``stop`` leaves no process behind."""

    def __init__(self, cwd: str, cell_timeout: float) -> None:
        from nbclient import NotebookClient
        self.cell_timeout = cell_timeout
        self.client = NotebookClient(nbformat.v4.new_notebook(), timeout=int(cell_timeout),
                                     allow_errors=True, interrupt_on_timeout=False,
                                     kernel_name="python3", shutdown_kernel="immediate",
                                     resources={"metadata": {"path": cwd}})
        self.client.km = self.client.create_kernel_manager()
        self.client.start_new_kernel()
        self.client.start_new_kernel_client()
        self.run(SAVE_STREAMS)

    def run(self, source: str) -> tuple[str, list, str]:
        """Run cell source; return (status, outputs, reason)."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError
        cell = nbformat.v4.new_code_cell(source)
        self.client.nb.cells = [cell]
        try:
            self.client.execute_cell(cell, 0)
        except CellTimeoutError:
            return ("timeout", cell.outputs, f"timed out after {self.cell_timeout:g} s "
                    f"(an infinite loop, or a wait that never ends)")
        except DeadKernelError:
            return "died", cell.outputs, "the kernel died (a crash, or os._exit)"
        size = len(json.dumps(cell.outputs))
        if size > MAX_CELL_OUTPUT_BYTES:
            # Kept, it would travel to the grader and into the journal; a lesson cell prints kB.
            return ("error", [], f"its outputs were {size / 2**20:.0f} MB, over the "
                    f"{MAX_CELL_OUTPUT_BYTES // 2**20} MB a graded cell may print")
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors:
            return "error", cell.outputs, reason(errors[0].ename, errors[0].evalue)
        return "ok", cell.outputs, ""

    def healthy(self) -> bool:
        status, outputs, _ = self.run(PROBE)
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        return status == "ok" and "ddplab-probe: ok" in text

    def stop(self) -> None:
        """Kill the kernel and wait until every process it started (engines, controller) is gone."""
        km = self.client.km
        pid = getattr(getattr(km, "provisioner", None), "pid", None) if km else None
        family = procs.Tree(procs.descendants(pid) if pid else [])   # found before it dies
        try:
            self.client._cleanup_kernel()
        except Exception:
            # A kernel that died already cannot be shut down politely; ending
            # its family below is what counts.
            log.debug("ddplab: the kernel's clean-up failed", exc_info=True)
        # ddplab's guard ends a lab within about a second of its kernel's death,
        # even an engine stuck in C++ that ignores SIGTERM; the grace is generous.
        family.end(grace=15)


def execute(steps: list[CellRun], cwd: str, cell_timeout: float) -> None:
    """Run ``steps`` in order, recording status, outputs and reasons on each.

    Called in a grading worker, a process that never runs a submission's code,
    after ``witness.prepare``: it runs each check cell it can itself
    (``ddplab.grade.witness``); the others run guarded in the kernel.
    """
    failed: set[str] = set()      # exercises already lost: replays use the reference solution
    kernel = Kernel(cwd, cell_timeout)
    try:
        for index, step in enumerate(steps):
            if step.skip:
                step.status = "ok"
                continue
            broke, began = False, time.monotonic()
            if step.role == "check" and witness.witnessable(step.source):
                broke = _witness(kernel, step, cwd, cell_timeout)
            elif step.role == "check":
                nonce = secrets.token_hex(16)
                step.status, outputs, step.error = kernel.run(guarded_check(step.source, nonce))
                said, step.outputs = verdict(outputs, nonce)
                if step.status == "ok" and said != "pass":
                    step.status = "error"
                    step.error = ("the check did not say it passed: its output was tampered "
                                  "with, or it never finished")
            else:
                step.status, step.outputs, step.error = kernel.run(step.source)
            step.seconds = time.monotonic() - began
            if step.status != "ok" and step.role in ("exercise", "check"):
                failed.add(step.name)
            if step.status == "error" and step.expect_error and step.role == "other":
                step.status = "ok"         # e.g. a HangError the notebook shows on purpose
            if step.status == "ok" or (step.status == "error" and not broke and kernel.healthy()):
                continue
            kernel.stop()
            kernel = _replay(steps[:index + 1], failed, cwd, cell_timeout)
            if kernel is None:
                why = f"not run: the kernel could not be recovered after {describe(step)} {step.status}"
                for later in steps[index + 1:]:
                    later.status, later.error = "not run", why
                return
    finally:
        if kernel is not None:
            kernel.stop()


def _witness(kernel: Kernel, step: CellRun, cwd: str, cell_timeout: float) -> bool:
    """Run check ``step`` in this process against the kernel's lab; True if that broke the lab.

    The kernel is asked only for data (where the lab is, the names the check
    cell gives the checker, its last trace); a kernel that will not answer
    fails the check.
    """
    status, outputs, why = kernel.run(witness.ask(step.source))
    found = witness.answer(outputs) if status == "ok" else None
    if found is None:
        step.status, step.outputs = "error", []
        step.error = ("the kernel did not answer the grader's question (where its lab is, and the "
                      "names the check uses)" + (f": {why}" if why else ""))
        return status in ("timeout", "died")
    step.outputs, error, broke = witness.check(step.source, found, cell_timeout, cwd)
    step.status, step.error = ("ok", "") if error is None else ("error", reason(*error))
    return broke


def _replay(done: list[CellRun], failed: set[str], cwd: str, cell_timeout: float) -> Kernel | None:
    """A new kernel in the state after ``done``, or None if the replay fails twice.

    One retry: on a loaded machine a replayed cell that passed before (the
    lab start, say) can fail once, and a kernel without it would fail every
    later check with a NameError that is not the student's doing.
    """
    for _ in range(2):
        kernel = _replay_once(done, failed, cwd, cell_timeout)
        if kernel is not None:
            return kernel
    return None


def _replay_once(done: list[CellRun], failed: set[str], cwd: str, cell_timeout: float) -> Kernel | None:
    kernel = Kernel(cwd, cell_timeout)
    for step in done:
        if step.skip:
            continue
        if step.role == "exercise" and step.name in failed:
            source = step.reference_source
        elif step.role == "other" and step.status != "ok":
            continue                       # the student's cell that broke things: not again
        else:
            source = step.source
        status, _, _ = kernel.run(source)
        # A cell that passed the first time must pass again; one that raises on
        # purpose (tagged raises-exception) or belongs to a lost exercise need not.
        must_pass = step.status == "ok" and not step.expect_error and step.name not in failed
        if status in ("timeout", "died") or (status != "ok" and must_pass):
            kernel.stop()
            return None
    if not kernel.healthy():
        kernel.stop()
        return None
    return kernel

