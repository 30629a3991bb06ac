"""A verdict for every way a job waits (issues 62 and 58, item 2), on real labs and real gloo.

A rank behind the others is said to have skipped a collective only when it has moved past
it; one still in its own code (asleep, in a queue's ``get``, in a ``subprocess.run``) is
late, and the verdict says where, with the line's text. A rank that returned while another
waits in a torch.distributed call is a verdict at once (``stall.StallWatch.abandoned``, or gloo's
"Connection closed by peer" read as what it is); a job in which one rank waits a whole
timeout ends, whatever the other ranks do.

Each test passes the shortest timeout that still shows its case and asserts that number;
time bounds are relative to it.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import time

import pytest
from conftest import cell_error

import ddplab

pytestmark = pytest.mark.slow

#: The cell deadline of the late-rank cases: rank 0 is in its all_reduce well before it.
TIMEOUT = 2.0
#: How long a hang report may spend reading the ranks' stacks and recorders.
REPORT_S = 5.0
#: The timeout of the cases that must end *within* it: long enough to tell "at once" from it.
LONG = 20.0


@pytest.fixture(scope="module", autouse=True)
def _recorders_from_one(lab):
    """The late verdicts read torch's flight recorder, whose counts on the default group are
    the lab's history: after an earlier module's lab.spawn (its group set aside and back) the
    ranks' counts differ and the recorder names no late rank (the headline still does). Each
    case here restarts the lab after it; this starts the module on a new group too."""
    lab.restart()


def _hang(lab, call, *args, **kwargs) -> tuple[str, float]:
    """The HangError ``call`` raises, as text, and how long it took; the lab restarted."""
    begin = time.monotonic()
    try:
        with pytest.raises(ddplab.HangError) as info:
            call(*args, **kwargs)
    finally:
        took = time.monotonic() - begin
        lab.restart()
    return str(info.value), took


def _line(fn, text: str) -> int:
    """The number of the line of ``fn``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# ------------------------------------------------------------------ late, not skipped (62)
#: The issue's snippet, typed in a notebook-like shell: its file is "<ipython-input-...>".
SLOW = """\
def slow():
    import time, torch, torch.distributed as dist
    if dist.get_rank() == 1: time.sleep(600)
    t = torch.ones(1); dist.all_reduce(t); return t.item()
"""


def _late_verdict(where: str) -> re.Pattern:
    """The verdict's words; the collective's number is the group's count so far (1 on a fresh
    lab, more on the suite's shared one), so any number stands."""
    before, after = ("ddplab: rank 0 waits in collective #", f" (all_reduce) on the default group, "
                     f"which rank 1 has not reached yet: it is still running its own code, {where}, "
                     f"not a torch.distributed call. It is late, not past the call, and may simply "
                     f"be slow: pass a longer timeout= (more than {TIMEOUT:g} s), or look at what "
                     f"keeps it there.")
    return re.compile(re.escape(before) + r"\d+" + re.escape(after))


def _assert_late_not_skipped(message: str, took: float) -> None:
    assert "never reached" not in message and "issued fewer" not in message, message
    assert "(a deadlock)" not in message, message
    assert message.startswith(f"ddplab: the cell did not finish within timeout={TIMEOUT:g} s; "
                              f"rank 0 waits for rank 1, which is still running its own code")
    assert TIMEOUT <= took < TIMEOUT + REPORT_S, f"HangError after {took:.1f} s"


def test_the_issues_sleeping_rank_is_late_in_slow_with_its_line_and_call(shell, fresh_lab):
    assert cell_error(shell, SLOW) is None
    begin = time.monotonic()
    error = cell_error(shell, f"ddplab.current().run(slow, timeout={TIMEOUT})")
    took = time.monotonic() - begin
    fresh_lab.restart()
    assert isinstance(error, ddplab.HangError), error
    message = str(error)
    assert _late_verdict("at slow line 3 (`if dist.get_rank() == 1: time.sleep(600)`)").search(message), \
        message
    assert "  rank 1: still in slow (slow line 3)" in message, message
    _assert_late_not_skipped(message, took)


def late_in_a_queue() -> None:
    import queue

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        jobs: queue.Queue = queue.Queue()
        jobs.get()  # nothing is ever put
    dist.all_reduce(torch.ones(1))


def late_in_a_subprocess() -> None:
    import subprocess
    import sys

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        subprocess.run([sys.executable, "-c", "import time; time.sleep(600)"])
    dist.all_reduce(torch.ones(1))


def test_a_rank_blocked_on_a_queue_get_is_late_and_named_in_it(fresh_lab):
    message, took = _hang(fresh_lab, fresh_lab.run, late_in_a_queue, timeout=TIMEOUT)
    line = _line(late_in_a_queue, "jobs.get()")
    assert _late_verdict(f"at late_in_a_queue line {line} (`jobs.get()  # nothing is ever put`), "
                         f"inside queue.get").search(message), message
    assert f"  rank 1: still in queue.get (late_in_a_queue line {line})" in message, message
    _assert_late_not_skipped(message, took)


def test_a_rank_in_subprocess_run_is_late_and_named_in_it(fresh_lab):
    message, took = _hang(fresh_lab, fresh_lab.run, late_in_a_subprocess, timeout=TIMEOUT)
    line = _line(late_in_a_subprocess, "subprocess.run(")
    assert _late_verdict(f'at late_in_a_subprocess line {line} (`subprocess.run([sys.executable, '
                         f'"-c", "import time; time.sleep(600)"])`), inside subprocess.run'
                         ).search(message), message
    _assert_late_not_skipped(message, took)


# ------------------------------------------------------------------ a rank that left (58, 2)
def rank_1_returns(wait_s: float = 0.0) -> None:
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))      # rank 1 never calls it
    else:
        time.sleep(wait_s)


def test_a_cell_whose_rank_returned_while_another_waits_ends_within_its_timeout(fresh_lab):
    message, took = _hang(fresh_lab, fresh_lab.run, rank_1_returns, timeout=LONG)
    assert message.startswith(
        "ddplab: rank 1 returned, and rank 0 waits in a torch.distributed call that needs it: "
        "every rank still running sits in one without using the CPU, so nothing is left to end "
        f"the wait. A hang, said now rather than at timeout={LONG:g} s."), message
    # The skipped-collective verdict keeps its words: rank 1 moved past the call (it returned).
    assert ("ddplab: rank 0 waits in collective #1 (all_reduce) on the default group, which rank 1 "
            "never reached: it issued fewer collectives") in message
    assert took < LONG / 2, f"HangError after {took:.1f} s"


DCP_SAVE = """\
import torch.distributed.checkpoint as dcp
model = torch.nn.Linear(3, 2)
"""


def test_only_rank_0_calling_dcp_save_is_said_within_the_timeout(fresh_lab, tmp_path):
    fresh_lab.run_cell(DCP_SAVE)                        # the import, outside the timed call
    folder = str(tmp_path / "checkpoint")
    message, took = _hang(fresh_lab, fresh_lab.run_cell,
                          f"if rank == 0:\n    dcp.save({{'model': model.state_dict()}}, "
                          f"checkpoint_id={folder!r})\n", timeout=LONG)
    assert message.startswith("ddplab: rank 1 returned, and rank 0 waits in a torch.distributed "
                              "call that needs it"), message
    assert "  rank 0: still in gather_object (cell line 2)" in message, message
    assert took < LONG / 2, f"HangError after {took:.1f} s"


def spawned_rank_1_leaves(rank: int, compute_s: float | None) -> int:
    """Rank 0 waits in its own group's all_reduce; rank 1 computes (for ever, with None) and,
    if it ever stops, returns without calling it."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=group)
    else:
        end = None if compute_s is None else time.process_time() + compute_s
        while end is None or time.process_time() < end:
            pass
    return rank


def test_a_spawned_rank_that_returns_while_another_waits_is_named(fresh_lab):
    begin = time.monotonic()
    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.spawn(spawned_rank_1_leaves, args=(0.0,), timeout=LONG)
    took = time.monotonic() - begin
    message = str(info.value)
    line = _line(spawned_rank_1_leaves, "dist.all_reduce(")
    assert message.startswith(
        f"ddplab: rank 0 waited in all_reduce (spawned_rank_1_leaves line {line}) for rank 1, which "
        "finished without making that call: when its process group closed, gloo ended the wait "
        "with \"Connection closed by peer\" (no rank crashed)."), message
    assert "a remote worker crashing" in message        # gloo's own words stay, below
    assert took < LONG / 2, f"RankError after {took:.1f} s"
    assert fresh_lab.healthy


def test_a_spawned_rank_that_computes_for_ever_while_another_waits_is_a_hang(fresh_lab):
    # limit= ends the job if the wait were not the hang (it was not, before: the CPU rank 1
    # used counted as the job's progress, for ever).
    message, took = _hang(fresh_lab, fresh_lab.spawn, spawned_rank_1_leaves, args=(None,),
                          timeout=TIMEOUT, limit=10 * TIMEOUT)
    line = _line(spawned_rank_1_leaves, "dist.all_reduce(")
    # The words of a launched job's verdict (ddplab.lab.verdicts), where it waits included.
    assert message.startswith(
        f"ddplab: rank 0 in all_reduce (spawned_rank_1_leaves line {line}): it has waited in that "
        f"torch.distributed call for timeout={TIMEOUT:g} s without it finishing, and that wait "
        f"is the hang, whatever the other ranks do meanwhile"), message
    # The collective's number and the group's name count what the lab's ranks ran before.
    assert re.search(r"rank 0 waits in collective #\d+ \(all_reduce\) on group \d+, which rank 1 has "
                     r"not reached yet: it is still running its own code, at spawned_rank_1_leaves "
                     r"line", message), message
    assert TIMEOUT <= took < 2 * TIMEOUT + REPORT_S, f"HangError after {took:.1f} s"


LEAVING_SCRIPT = textwrap.dedent("""\
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.barrier()                       # rank 1's script ends without it
""")


def test_a_script_that_ends_on_one_rank_while_another_waits_is_named(fresh_lab, tmp_path):
    script = tmp_path / "leaving.py"
    script.write_text(LEAVING_SCRIPT)
    begin = time.monotonic()
    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.run_script(str(script), timeout=LONG)
    took = time.monotonic() - begin
    assert str(info.value).startswith(
        "ddplab: rank 0 waited in barrier (leaving.py line 5) for rank 1, which finished without "
        "making that call"), str(info.value)
    assert took < LONG / 2, f"RankError after {took:.1f} s"


SAVE_ON_RANK_0 = """
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

def save_sharded(path, model, optimizer, epoch):
    model_state, optim_state = get_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        dcp.save({"model": model_state, "optim": optim_state, "epoch": epoch}, checkpoint_id=path)
"""


def test_the_checkpoint_check_of_a_save_on_rank_0_only_fails_well_within_its_timeout(fresh_lab):
    # Last round's case: 121.7 s, the check's whole timeout. Rank 0 waits in dcp.save's gather,
    # rank 1 in the check's barrier after the student's function: collectives that disagree.
    from ddplab.check.nb10_checkpoints_and_failures import sharded_checkpoints as checkpoints

    fresh_lab.run_cell(SAVE_ON_RANK_0)
    begin = time.monotonic()
    try:
        with pytest.raises(AssertionError, match=r"rank 0: still in gather_object"):
            ddplab.check.save_sharded()
    finally:
        took = time.monotonic() - begin
        fresh_lab.restart()
    assert took < checkpoints._TIMEOUT / 2, f"the check failed after {took:.1f} s"
