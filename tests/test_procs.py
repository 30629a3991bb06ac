"""ddplab.procs: one policy for ending process trees, tried on real process trees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ddplab import procs

# A process that starts ``depth`` generations below itself, each sleeping, and
# prints the pids of the whole chain once it is complete.
CHAIN = textwrap.dedent("""
    import os, subprocess, sys, time
    depth = int(sys.argv[1])
    if depth:
        child = subprocess.Popen([sys.executable, sys.argv[0], str(depth - 1)] + sys.argv[2:],
                                 stdout=subprocess.PIPE, text=True)
        below = child.stdout.readline().strip()
    else:
        below = ""
    print(" ".join(filter(None, [str(os.getpid()), below])), flush=True)
    time.sleep(600)
""")


def _script(tmp_path, text, name="chain.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _chain(tmp_path, depth: int, *, ignore_term: bool = False) -> tuple[subprocess.Popen, list[int]]:
    text = CHAIN if not ignore_term else \
        "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + CHAIN
    proc = procs.start([sys.executable, _script(tmp_path, text), str(depth)],
                       stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == depth + 1, pids
    return proc, pids


def _gone(pids) -> bool:
    return not any(procs.alive(pid) for pid in pids)


def test_end_tree_ends_every_generation_politely_and_fast(tmp_path):
    proc, pids = _chain(tmp_path, 3)
    grace = 20.0
    begin = time.monotonic()
    assert procs.end_tree(proc, grace=grace) == []
    took = time.monotonic() - begin
    assert _gone(pids)
    # SIGTERM ended them: nobody waited for the grace period to run out.
    assert took < grace / 2, f"ending a tree that obeys SIGTERM took {took:.1f} s of {grace} s"
    assert proc.wait(5) == -signal.SIGTERM       # its Popen still sees how it ended


def test_what_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    proc, pids = _chain(tmp_path, 2, ignore_term=True)
    grace = 1.0
    begin = time.monotonic()
    assert procs.end_tree(proc, grace=grace) == []
    took = time.monotonic() - begin
    assert _gone(pids)
    assert took >= grace, f"the tree was killed after {took:.2f} s, before grace={grace} s"
    assert proc.wait(5) == -signal.SIGKILL


def test_children_get_sigterm_before_their_parents(tmp_path):
    # Each process records the order in which SIGTERM reached the chain.
    log = tmp_path / "order.txt"
    text = textwrap.dedent(f"""
        import os, signal, sys
        def on_term(*_):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
    """) + CHAIN
    proc = procs.start([sys.executable, _script(tmp_path, text), "2"], stdout=subprocess.PIPE,
                       text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert procs.end_tree(proc, grace=20) == []
    assert _gone(pids)
    # Every one got SIGTERM (none needed SIGKILL), and each child was signalled before
    # its parent, so each handler ran while its parent was still waiting for it.
    assert sorted(int(p) for p in log.read_text().split()) == sorted(pids)


def test_an_orphan_noted_while_running_is_ended_too(tmp_path):
    # The middle process exits, so the grandchild is handed to init and is no
    # longer anyone's descendant: only a Tree that noted it can end it.
    text = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        sys.stdin.readline()
    """)
    proc = procs.start([sys.executable, _script(tmp_path, text, "orphan.py")],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    orphan = int(proc.stdout.readline())
    tree = procs.Tree([proc])
    tree.note()
    proc.stdin.close()                           # the middle process exits now
    assert proc.wait(20) == 0
    assert procs.alive(orphan) and orphan not in [p.pid for p in procs.descendants(proc.pid)]
    assert tree.end(grace=20) == []
    assert not procs.alive(orphan)


def test_sessions_reach_a_daemon_nobody_noted(tmp_path):
    # A double fork: the daemon leaves no trace in the tree, but stays in the session.
    pid_file = tmp_path / "daemon.pid"
    text = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            if os.fork() == 0:
                open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
                os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
                time.sleep(600)
            os._exit(0)
        time.sleep(600)
    """)
    proc = procs.start([sys.executable, _script(tmp_path, text, "daemon.py")])
    deadline = time.monotonic() + 30
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the daemon did not start within 30 s"
        time.sleep(0.05)
    daemon = int(pid_file.read_text())
    assert daemon not in [p.pid for p in procs.descendants(proc.pid)]
    assert procs.Tree([proc], sessions=True).end(grace=20) == []
    assert not procs.alive(daemon) and proc.poll() is not None


def test_a_tree_that_keeps_forking_is_ended(tmp_path):
    text = textwrap.dedent("""
        import subprocess, sys, time
        print("started", flush=True)
        while True:
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            time.sleep(0.05)
    """)
    proc = procs.start([sys.executable, _script(tmp_path, text, "forker.py")],
                       stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    time.sleep(0.5)
    tree = procs.Tree([proc])
    tree.note()
    assert tree.end(grace=20) == []
    assert all(not procs.alive(m) for m in tree.members) and len(tree.members) > 1


def test_a_reused_pid_is_never_signalled(tmp_path):
    # A handle taken for an earlier process with the same pid: psutil sees the
    # start time differs, and procs leaves the process that has the pid now alone.
    proc = procs.start([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        handle = psutil.Process(proc.pid)
        pid, started = handle._ident
        handle._ident = (pid, started - 100)     # as if taken before the pid was reused
        assert procs.send(handle, signal.SIGKILL) is False
        assert not procs.alive(handle)
        assert procs.Tree([handle]).end(grace=0) == []
        assert proc.poll() is None, "a process that only shares the pid was signalled"
    finally:
        assert procs.end_tree(proc, grace=5) == []
    assert proc.wait(5) == -signal.SIGTERM


def test_helpers_on_gone_processes():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert procs.process(proc) is None and procs.descendants(proc.pid) == []
    assert not procs.alive(proc.pid) and procs.send(proc.pid, signal.SIGTERM) is False
    assert procs.end_tree(proc.pid) == []
    assert procs.Tree([os.getpid()]).members == []      # never this process itself


@pytest.mark.parametrize("grace", [0.0, 2.0])
def test_grace_zero_kills_at_once(tmp_path, grace):
    proc, pids = _chain(tmp_path, 1, ignore_term=True)
    begin = time.monotonic()
    assert procs.end_tree(proc, grace=grace) == []
    assert _gone(pids)
    took = time.monotonic() - begin
    assert (took < procs.KILL_WAIT_S) if grace == 0 else (took >= grace)


def test_a_session_is_ended_after_its_leader_is_gone(tmp_path):
    # The leader starts a daemon and exits: nothing links the daemon to anyone but the
    # session id, which Linux does not reuse while the session has a member.
    pid_file = tmp_path / "daemon.pid"
    text = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
            os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
            time.sleep(600)
        while not os.path.exists({str(pid_file)!r}):
            time.sleep(0.01)
    """)
    leader = procs.start([sys.executable, _script(tmp_path, text, "leader.py")])
    assert leader.wait(30) == 0
    daemon = int(pid_file.read_text())
    assert procs.alive(daemon)
    tree = procs.Tree()
    tree.add_session(leader.pid)
    assert tree.end(grace=0) == []
    assert not procs.alive(daemon)


def test_run_command_runs_a_short_command_to_its_end_as_subprocess_run_does():
    done = procs.run_command([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"],
                             capture_output=True, text=True, timeout=60)
    assert isinstance(done, subprocess.CompletedProcess)
    assert (done.returncode, done.stdout) == (3, "out\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run_command([sys.executable, "-c", "import time; time.sleep(600)"], timeout=1)
    assert time.monotonic() - start < 60, "killed at its timeout, not left to run"
    with pytest.raises(OSError):
        procs.run_command(["/nonexistent/ddplab-no-such-command"], timeout=5)
