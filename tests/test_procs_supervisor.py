"""ddplab.procs.Group: commands by rank, waited with a timeout and a settle time, ended as one tree.

Every test runs real processes. They meet through files (a rank writes one,
another waits for it), never through sleeps that hope the other side is ready.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from ddplab import procs

PY = sys.executable
# Long enough never to run out on a busy machine in the tests that must not time out.
LONG = 120.0


def python(text: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(text)]


def waits_for(path: Path, then: str = "") -> list[str]:
    """A command that waits (up to LONG) until ``path`` exists, then runs ``then``."""
    return python(f"""
        import os, sys, time
        deadline = time.monotonic() + {LONG}
        while not os.path.exists({str(path)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        {then}
    """)


def pid_in(path: Path, timeout: float = 30) -> int:
    """The pid a process wrote to ``path`` (whole: written beside it, then renamed)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no pid in {path} within {timeout:g} s"
        time.sleep(0.01)
    return int(path.read_text())


def write_pid(path: Path) -> str:
    return (f"open({str(path)!r} + '.tmp', 'w').write(str(os.getpid())); "
            f"os.rename({str(path)!r} + '.tmp', {str(path)!r})")


def test_output_comes_back_by_rank_in_rank_order():
    # Rank 2 prints first and rank 0 last: results are still in rank order.
    commands = [python(f"""
        import sys
        print("out of rank {rank}", flush=True)
        print("err of rank {rank}", file=sys.stderr, flush=True)
    """) for rank in range(3)]
    ran = procs.run(commands, LONG)
    assert ran.ok and not ran.timed_out and ran.returncodes == [0, 0, 0]
    assert [e.rank for e in ran] == [0, 1, 2] and len(ran) == 3
    for rank in range(3):
        assert ran[rank].output == f"out of rank {rank}\nerr of rank {rank}\n"
        assert ran[rank].command == commands[rank] and not ran[rank].ended


def test_lines_stream_to_on_line_while_the_command_runs(tmp_path):
    # The command goes on only once on_line has seen its first line: it streamed.
    seen, flag = [], tmp_path / "seen"

    def on_line(rank: int, line: str) -> None:
        seen.append((rank, line))
        if line == "first":
            flag.touch()

    command = waits_for(flag, "print('second'); print('no newline', end='')")
    command[-1] = "print('first', flush=True)\n" + command[-1]
    ran = procs.run([command], LONG, on_line=on_line)
    assert ran.ok, ran[0].output
    assert seen == [(0, "first"), (0, "second"), (0, "no newline")]
    assert ran[0].output == "first\nsecond\nno newline"


@pytest.mark.parametrize("output, kept", [("all", "out\nerr\n"), ("stdout", "out\n"),
                                          ("stderr", "err\n")])
def test_output_keeps_what_it_is_asked_to(output, kept, capfd):
    command = python("import sys; print('out', flush=True); print('err', file=sys.stderr)")
    ran = procs.run([command], LONG, output=output)
    assert ran[0].output == kept
    # "stdout": stderr stays this process's; "stderr": stdout is discarded.
    assert capfd.readouterr() == ("", "err\n" if output == "stdout" else "")


def test_a_failure_ends_the_others_after_the_settle_time():
    settle = 2.0
    begin = time.monotonic()
    ran = procs.run([python("raise SystemExit(3)"), python("import time; time.sleep(600)")],
                    LONG, settle=settle)
    took = time.monotonic() - begin
    assert settle <= took < LONG
    assert not ran.ok and not ran.timed_out
    assert ran.returncodes == [3, None]           # None: ended by the group
    assert ran[0].failed and not ran[0].ended and ran[0].signal is None
    assert ran[1].ended and not ran[1].failed and ran[1].signal == signal.SIGTERM
    assert list(ran.failures) == [0]


def test_settle_zero_ends_the_others_at_once():
    ran = procs.run([python("raise SystemExit(3)"), python("import time; time.sleep(600)")],
                    LONG, settle=0)
    assert ran.returncodes == [3, None] and not ran.timed_out


def test_ranks_that_exit_within_the_settle_time_keep_their_own_error(tmp_path):
    # Rank 1 fails because rank 0 did, and says so: its message is kept, and the
    # group does not wait out the settle time once everyone has exited.
    failed = tmp_path / "rank0-failed"
    first = python(f"open({str(failed)!r}, 'w').close(); raise SystemExit(3)")
    second = waits_for(failed, "print('peer is gone', flush=True); sys.exit(4)")
    begin = time.monotonic()
    ran = procs.run([first, second], LONG, settle=LONG)
    assert time.monotonic() - begin < LONG
    assert ran.returncodes == [3, 4] and list(ran.failures) == [0, 1]
    assert ran[1].output == "peer is gone\n" and not ran[1].ended


def test_a_timeout_ends_the_whole_tree(tmp_path):
    # Rank 0 leaves a double-forked daemon in its session (nothing links it to
    # rank 0 but the session). Rank 1 starts a child in a session of its own,
    # as torchrun starts its workers; the group notes it while it waits, and
    # its parent exits before the end, so only that note reaches it.
    daemon, worker, release = tmp_path / "daemon.pid", tmp_path / "worker.pid", tmp_path / "go"
    rank0 = python(f"""
        import os, time
        if os.fork() == 0:
            if os.fork() == 0:
                {write_pid(daemon)}
                time.sleep(600)
            os._exit(0)
        time.sleep(600)
    """)
    worker_script = tmp_path / "worker.py"
    worker_script.write_text(f"import os, time\n{write_pid(worker)}\ntime.sleep(600)\n")
    middle_script = tmp_path / "middle.py"           # starts the worker, exits when told
    middle_script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, {str(worker_script)!r}], start_new_session=True)
    """) + waits_for(release)[-1])
    rank1 = python(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, {str(middle_script)!r}]).wait()
        time.sleep(600)
    """)
    group = procs.Group([rank0, rank1]).start()
    try:
        daemon_pid, worker_pid = pid_in(daemon), pid_in(worker)
        group.poll()                             # notes the worker, then its parent goes
        middle = psutil.Process(worker_pid).parent()
        release.touch()
        middle.wait(LONG)
        assert worker_pid not in [p.pid for p in procs.descendants(group.processes[1])]
        assert procs.alive(daemon_pid) and procs.alive(worker_pid)
        timeout = 1.0
        begin = time.monotonic()
        ran = group.wait(timeout)
        assert time.monotonic() - begin >= timeout
    finally:
        group.close()
    assert ran.timed_out and not ran.ok and ran.returncodes == [None, None]
    assert [e.signal for e in ran] == [signal.SIGTERM, signal.SIGTERM]
    assert not procs.alive(daemon_pid) and not procs.alive(worker_pid)


def test_an_error_while_waiting_still_ends_every_process():
    def on_line(rank: int, line: str) -> None:
        raise RuntimeError("the display broke")

    group = procs.Group([python("import time; print('hi', flush=True); time.sleep(600)")],
                        on_line=on_line).start()
    with pytest.raises(RuntimeError, match="the display broke"):
        group.wait(LONG)
    assert group.processes[0].returncode == -signal.SIGTERM


def test_a_command_that_cannot_start_ends_those_that_did(tmp_path):
    group = procs.Group([python("import time; time.sleep(600)"), [str(tmp_path / "missing")]])
    with pytest.raises(FileNotFoundError):
        group.start()
    assert len(group.processes) == 1 and group.processes[0].returncode is not None


def test_wait_for_line_sees_a_line_or_the_exit():
    with procs.Group([python("import time; print('ready', flush=True); time.sleep(600)"),
                      python("print('never ready')")]) as group:
        assert group.wait_for_line(0, "ready")
        assert not group.wait_for_line(1, "ready")
        assert procs.alive(group.processes[0])
    assert not procs.alive(group.processes[0])
    assert group.close()[1].output == "never ready\n"


def test_a_bad_output_choice_is_refused():
    with pytest.raises(ValueError, match="output must be one of"):
        procs.Group([["true"]], output="both")


def test_each_command_leads_a_session_unless_told_otherwise():
    # Its own session: the kernel's Ctrl-C is not its. In ours (ddplab grade's
    # workers): a terminal's Ctrl-C reaches it too.
    say = python("import os; print(os.getsid(0), os.getpid())")
    own, ours = procs.run([say], LONG), procs.run([say], LONG, session=False)
    session, pid = map(int, own[0].output.split())
    assert session == pid
    session, pid = map(int, ours[0].output.split())
    assert session == os.getsid(0) != pid


# ------------------------------------------------------------ a no-progress timeout
def test_a_job_that_prints_or_computes_past_its_timeout_runs_to_its_end():
    printing = python("""
        import time
        for step in range(8):
            print("step", step, flush=True)
            time.sleep(0.25)            # quiet between lines: only the output shows progress
    """)
    computing = python("""
        import time
        end = time.process_time() + 1.0
        while time.process_time() < end:
            pass                        # 1 s of CPU, past the timeout on any machine; no output
        print("done", flush=True)
    """)
    timeout = 0.5
    # A plain timeout ends the printing job: the same job is what the no-progress one lets run.
    assert procs.Group([printing]).start().wait(timeout).stopped == "timeout"
    ran = procs.Group([printing, computing]).start().wait(timeout, progress=True)
    assert ran.ok and ran.stopped == "", ran
    assert ran[0].output.split() == [word for step in range(8) for word in ("step", str(step))]
    assert ran[1].output == "done\n"


def test_a_job_winding_down_after_its_worker_ended_is_not_stalled():
    # torchrun's shape: a worker computes and exits, its parent (the agent) reaps it and closes
    # quietly. The worker's end is progress, and its CPU counts once reaped (children's times).
    agent = python("""
        import subprocess, sys, time
        subprocess.run([sys.executable, "-c",
                        "import time\\nend = time.process_time() + 1.3\\n"
                        "while time.process_time() < end:\\n    pass"])
        time.sleep(0.9)                 # quiet, idle: closing down (under a timeout)
        print("closed", flush=True)
    """)
    ran = procs.Group([agent]).start().wait(1.0, progress=True)
    assert ran.ok and ran[0].output == "closed\n", ran


def test_a_quiet_idle_job_is_stalled_and_a_limit_caps_a_busy_one():
    timeout = 1.0
    begin = time.monotonic()
    ran = procs.Group([python("import time; time.sleep(600)")]).start().wait(timeout, progress=True)
    took = time.monotonic() - begin
    assert ran.timed_out and ran.stopped == "stalled" and ran.returncodes == [None]
    # Python's start uses the CPU in the first window: the second (or, loaded, third) ends it.
    assert timeout <= took < 4 * timeout + procs.END_GRACE_S, took
    busy = python("while True:\n    pass")
    ran = procs.Group([busy]).start().wait(timeout, progress=True, limit=2 * timeout)
    assert ran.timed_out and ran.stopped == "limit"
