"""A long job is not a hang (``ddplab.lab.stall``), on real engines and real gloo.

``lab.spawn`` and ``lab.run_script`` wait while the job makes progress and stop only after a
whole timeout in which no rank did; a result that takes long to send is not a hang; a
``launch`` that prints on is not one either. Timeouts here are short (a second or two) and
each job runs for several of them, so each test shows the difference: before this, every job
here was ended as "a deadlock" at its first timeout.
"""

from __future__ import annotations

import logging
import textwrap
import time

import pytest
from conftest import cell_error

import ddplab
from ddplab import launch
from ddplab.lab import stall

#: The tests that start jobs on the session lab, or a launch, are of the slow tier; the
#: decisions on recorded stacks and readings below are not.
slow = pytest.mark.slow

TIMEOUT = 1.0
#: Steps of each job, and the seconds each takes (asleep, or of CPU time): 3 timeouts or more.
STEPS, STEP_S = 12, 0.25
#: The CPU seconds of each step of the computing job: 1.2 s of CPU a rank in all, so at
#: least that in wall time (more on a loaded machine), past the timeout on any machine.
CPU_STEP_S = 0.1
#: How long a hang report may spend reading the ranks' stacks and recorders.
REPORT_S = 5.0


def computing_job(rank: int, steps: int, step_s: float) -> float:
    """A training loop in small: each step computes (plain Python, on the CPU), then all-reduces."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        end = time.process_time() + step_s
        while time.process_time() < end:
            pass
        dist.all_reduce(t)               # doubles t on 2 ranks
    dist.destroy_process_group()
    return t.item()


def deadlocked_job(rank: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.recv(torch.zeros(1), src=1 - rank)       # both ranks receive first: nobody sends


#: A script that spends its time asleep between collectives: no CPU to speak of, so only its
#: collectives (the flight recorder) and where it is show that it progresses.
SLEEPY_SCRIPT = f"""
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1, dtype=torch.float64)
for _ in range({STEPS}):
    time.sleep({STEP_S})
    dist.all_reduce(t)
print("sum", int(t.item()))
dist.destroy_process_group()
"""


@slow
def test_a_spawned_job_that_computes_past_its_timeout_returns_its_result(fresh_lab, caplog):
    caplog.set_level(logging.DEBUG, logger="ddplab.lab.stall")
    begin = time.monotonic()
    result = fresh_lab.spawn(computing_job, args=(STEPS, CPU_STEP_S), timeout=TIMEOUT)
    assert result == [2.0 ** STEPS] * 2
    assert time.monotonic() - begin > STEPS * CPU_STEP_S > TIMEOUT   # it ran past the timeout
    assert "the job is not stuck at its timeout" in caplog.text
    assert fresh_lab.healthy


@slow
def test_a_limit_caps_a_job_that_makes_progress(fresh_lab):
    begin = time.monotonic()
    with pytest.raises(ddplab.HangError) as info:
        fresh_lab.spawn(computing_job, args=(1000, CPU_STEP_S), timeout=TIMEOUT, limit=1.5 * TIMEOUT)
    assert time.monotonic() - begin < 1.5 * TIMEOUT + REPORT_S
    message = str(info.value)
    assert message.startswith(f"ddplab: the job ran for limit={1.5 * TIMEOUT:g} s, its cap, and was "
                              f"stopped; it made progress"), message
    assert "never reached" not in message and "(a deadlock)" not in message


@slow
def test_a_script_that_sleeps_between_collectives_runs_to_its_end(fresh_lab, tmp_path, capsys):
    script = tmp_path / "sleepy.py"
    script.write_text(SLEEPY_SCRIPT)
    begin = time.monotonic()
    fresh_lab.run_script(str(script), timeout=TIMEOUT)
    assert time.monotonic() - begin > STEPS * STEP_S > 2 * TIMEOUT
    assert capsys.readouterr().out.count(f"sum {2 ** STEPS}\n") == 2


@slow
def test_a_deadlock_under_spawn_stops_within_two_timeouts_saying_so(fresh_lab):
    begin = time.monotonic()
    with pytest.raises(ddplab.HangError) as info:
        fresh_lab.spawn(deadlocked_job, timeout=TIMEOUT)
    took = time.monotonic() - begin
    # The first window may hold the group's forming (CPU): the second is the one with none.
    assert TIMEOUT <= took < 2 * TIMEOUT + REPORT_S, f"HangError after {took:.1f} s"
    message = str(info.value)
    assert message.startswith(f"ddplab: the job made no progress for timeout={TIMEOUT:g} s: every rank waits "
                              f"in communication"), message
    assert "(a deadlock)" in message and "rank 0: still in recv" in message


@slow
def test_a_big_result_is_not_a_hang(fresh_lab, caplog):
    # 64 MB a rank: pickled twice on each rank (once to check it can be sent) and carried
    # through the controller, 1 to 2 s here, several times the 0.3 s timeout; 256 MB takes
    # 5 s and proves no more. The function itself returns at once: all the time is sending.
    caplog.set_level(logging.DEBUG, logger="ddplab.lab.stall")
    numel = 16 * 2 ** 20
    fresh_lab.run(make_big, numel)
    values = fresh_lab.run(give_big, timeout=0.3)
    assert [(v.numel(), v[0].item(), v[-1].item()) for v in values] == [(numel, 0.0, 0.0),
                                                                        (numel, 1.0, 1.0)]
    assert "have returned; their results are on the way" in caplog.text
    fresh_lab.run(drop_big)


def make_big(numel: int) -> None:
    import torch
    import torch.distributed as dist

    from ddplab.rank import engine
    engine.namespace()["_big"] = torch.full((numel,), float(dist.get_rank()))


def give_big():
    from ddplab.rank import engine
    return engine.namespace()["_big"]


def drop_big() -> None:
    from ddplab.rank import engine
    engine.namespace().pop("_big", None)


@slow
def test_a_cell_queued_behind_a_busy_rank_cell_names_the_earlier_cells_line(shell, fresh_lab):
    assert cell_error(shell, "%%rank 0 --grace 0.5\nimport time\nx = 1\ntime.sleep(60)") is None
    error = cell_error(shell, "%%ranks --timeout 1\ny = 2\nz = 3\nprint(y + z)")
    assert isinstance(error, ddplab.HangError)
    assert ("rank 0: still in <module> (cell line 3) of the earlier cell, which still runs there "
            "(this cell waits behind it)") in str(error), str(error)
    assert "rank 1: finished" in str(error)


@slow
def test_a_launched_job_that_prints_past_its_timeout_completes(tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(textwrap.dedent(f"""
        import time
        for step in range({STEPS}):
            print(f"[rank 0] step {{step}}", flush=True)
            time.sleep({STEP_S})
    """))
    result = launch.spawn(str(script), nprocs=1, timeout=TIMEOUT)
    assert result.ok
    assert result.rank_output[0].split("\n")[-2] == f"step {STEPS - 1}"


# ------------------------------------------------------------ the decisions, on recorded readings
ENGINE = "/x/site-packages/ddplab/rank/engine.py"
C10D = "/x/site-packages/torch/distributed/distributed_c10d.py"


def test_a_rank_has_returned_once_no_frame_runs_the_call():
    in_code = [("/home/me/train.py", 12, "step"), (ENGINE, 299, "call")]
    checking = [("/x/site-packages/cloudpickle/cloudpickle.py", 1313, "dump"),
                (ENGINE, 331, "_sendable"), (ENGINE, 305, "call")]
    sending = [("/x/site-packages/ipyparallel/serialize/serialize.py", 113, "serialize_object"),
               ("/x/site-packages/ipyparallel/engine/kernel.py", 168, "do_apply")]
    assert not stall.code_returned(in_code)
    assert not stall.code_returned([(C10D, 9, "all_reduce"), *in_code])
    assert stall.code_returned(checking) and stall.code_returned(sending)
    assert not stall.code_returned([])           # an unread stack proves nothing


class Readings:
    """A ``Ranks`` that answers ``Watch``'s three questions from lists, one answer per look."""

    def __init__(self, cpu: list[float], flight: list[str], frames: list) -> None:
        self._cpu, self._flight, self._frames = cpu, flight, frames

    def cpu_seconds(self, ranks):
        return {rank: self._cpu.pop(0) for rank in ranks}

    def collectives(self, ranks, deadline):
        return {rank: [self._flight.pop(0)] for rank in ranks}

    def frames(self, ranks, deadline):
        return {rank: self._frames.pop(0) for rank in ranks}


IN_RECV = [(C10D, 9, "recv"), ("/home/me/train.py", 3, "main"), (ENGINE, 299, "call")]
ASLEEP = [("/home/me/train.py", 7, "main"), (ENGINE, 299, "call")]


@pytest.mark.parametrize("cpu,flight,frames,stopped", [
    ([0.0, 5.0, 5.0], ["a", "a", "a"], [IN_RECV, IN_RECV], ""),        # it computed: on
    ([0.0, 0.0, 0.0], ["a", "b", "b"], [IN_RECV, IN_RECV], ""),        # a collective moved: on
    ([0.0, 0.01, 0.02], ["a", "a", "a"], [IN_RECV, IN_RECV], "stalled"),  # a gloo wait's CPU
    ([0.0, 0.0, 0.0], ["a", "a", "a"], [ASLEEP, ASLEEP], "stalled"),
])
def test_a_job_runs_on_while_a_rank_progresses(cpu, flight, frames, stopped):
    watch = stall.StallWatch(Readings(cpu, flight, frames), job=True)
    watch.begin([0])
    watch._looked -= 1.0                          # the window: one second
    assert bool(watch.more([0], 1.0)) == (not stopped)
    if stopped:                                   # the second look finds nothing new either
        assert watch.stopped == "stalled"
    else:
        watch._looked -= 1.0
        assert not watch.more([0], 1.0) and watch.stopped == "stalled"


def test_a_stalled_jobs_report_says_who_waits_in_communication():
    watch = stall.StallWatch(Readings([], [], []), job=True)
    watch.stopped, watch.waiting = "stalled", {0: True, 1: True}
    assert watch.headline(60) == ("ddplab: the job made no progress for timeout=60 s: every rank waits in "
                                  "communication (no CPU time used, no collective finished), so "
                                  "they are waiting for each other (a deadlock).")
    watch.waiting = {0: False, 1: True}
    assert watch.headline(60) == (
        "ddplab: the job made no progress for timeout=60 s: rank 0 is in its own code, not a "
        "torch.distributed call, but sits there without using the CPU (sleeping, or waiting on a "
        "lock, a file, a queue), and rank 1 waits in communication (for it).")
    assert stall.StallWatch(Readings([], [], [])).headline(60) == ""    # a cell's deadline: as before
