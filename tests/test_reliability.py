"""Fault injection on real engines and real gloo: hangs, failures, deaths, orphans.

Each test asserts on the message a student would read, on generous timings,
and on leftover processes.
"""

import _thread
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import alive, listening_addresses, side_lab

import ddplab
from ddplab import procs

pytestmark = pytest.mark.slow


def _when_file_exists(path, action, limit=30.0):
    """Run ``action`` in a thread as soon as ``path`` exists (a rank creates it)."""
    def watch():
        deadline = time.monotonic() + limit
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


HANG_TIMEOUT = 3
# How long the lab may spend reading the stuck ranks' stacks (Lab._hang_error).
STACKS_S = 4


def _hang(lab, source, timeout=HANG_TIMEOUT):
    begin = time.monotonic()
    with pytest.raises(ddplab.HangError) as info:
        lab.run_cell(source, timeout=timeout)
    return info.value, time.monotonic() - begin


def _soon_after_the_timeout(took: float, timeout: float = HANG_TIMEOUT) -> bool:
    """The HangError came at the timeout, after at most the stacks' reading and a second."""
    return timeout <= took < timeout + STACKS_S + 1


# 1. Hang diagnosis ------------------------------------------------------------

#: The timeout of a hang in which a rank finished while another waits: said before it ends.
EARLY_TIMEOUT = 10


def _said_early(error, took: float) -> bool:
    """A rank that finished while the other waits is a hang at once (``stall.Watch.abandoned``),
    well before the timeout."""
    return (str(error).startswith("ddplab: rank 1 returned, and rank 0 waits in a "
                                  "torch.distributed call that needs it")
            and took < EARLY_TIMEOUT / 2 + STACKS_S)


def test_collective_called_by_one_rank_only(fresh_lab):
    error, took = _hang(fresh_lab, "x = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(x)",
                        timeout=EARLY_TIMEOUT)
    assert _said_early(error, took), f"HangError after {took:.1f} s: {error}"
    assert error.states == {0: "still running", 1: "finished"}
    assert "rank 0: still in all_reduce (cell line 3)" in str(error)
    assert "rank 1: finished" in str(error)
    assert 'File "<rank cell' in error.stacks[0]
    assert str(error).endswith("Recover with: lab.restart()")
    begin = time.monotonic()
    fresh_lab.restart()
    assert time.monotonic() - begin < 15
    assert fresh_lab.run(lambda: __import__("torch.distributed").distributed.get_rank()) == [0, 1]


def test_send_without_recv(fresh_lab):
    error, took = _hang(fresh_lab, "if rank == 0:\n    dist.send(torch.ones(4), dst=1)",
                        timeout=EARLY_TIMEOUT)
    assert _said_early(error, took), f"HangError after {took:.1f} s: {error}"
    assert "rank 0: still in send (cell line 2)" in str(error)
    with pytest.raises(ddplab.DdplabError, match=r"Recover with: lab.restart\(\)"):
        fresh_lab.run(print)                      # the stuck lab says so, it does not hang


def test_both_ranks_send_first(fresh_lab):
    error, took = _hang(fresh_lab, "out = torch.ones(2)\ndist.send(out, dst=1 - rank)\n"
                                   "dist.recv(out, src=1 - rank)")
    assert _soon_after_the_timeout(took), f"HangError after {took:.1f} s"
    assert error.where == {0: "in send (cell line 2)", 1: "in send (cell line 2)"}


def test_process_group_timeout_is_finite():
    timeout, pg_timeout = 30, 2
    with ddplab.start(world_size=2, backend="gloo", timeout=timeout, pg_timeout=pg_timeout) as lab:
        begin = time.monotonic()
        with pytest.raises(ddplab.RankError) as info:
            lab.run_cell("if rank == 0:\n    dist.recv(torch.ones(1), src=1)")
        # The group's own timeout ended the recv, long before the lab's.
        assert time.monotonic() - begin < (pg_timeout + timeout) / 2
        assert list(info.value.failures) == [0]
        assert "recv" in info.value.failures[0]


# 2. Interrupt ----------------------------------------------------------------

@pytest.fixture
def python_sigint():
    """SIGINT handled by Python (KeyboardInterrupt) while the test runs, as in a kernel.

    ``_thread.interrupt_main`` does nothing unless Python handles SIGINT, and in one whole
    suite run both tests below saw no KeyboardInterrupt until the cell's timeout, while they
    pass alone: whatever an earlier test left as the handler, these tests set Python's.
    """
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


# The rank makes the marker at once; if it were not seen, the interrupt comes after INTERRUPT_BY
# anyway, well inside the cell's timeout, so what is tested is still the interrupt.
INTERRUPT_BY = 10.0


def test_interrupt_stops_python_work_and_lab_stays_usable(fresh_lab, tmp_path, capsys,
                                                          python_sigint):
    marker = tmp_path / "started"
    _when_file_exists(marker, _thread.interrupt_main, limit=INTERRUPT_BY)
    with pytest.raises(KeyboardInterrupt):
        fresh_lab.run_cell(f"open({str(marker)!r}, 'w').close()\nimport time\ntime.sleep(60)")
    assert "the ranks stopped and the lab is usable" in capsys.readouterr().out
    assert fresh_lab.run(lambda: 1) == [1, 1]


def test_interrupt_of_rank_blocked_in_cpp_says_restart(fresh_lab, tmp_path, capsys, python_sigint):
    marker = tmp_path / "started"
    _when_file_exists(marker, _thread.interrupt_main, limit=INTERRUPT_BY)
    with pytest.raises(KeyboardInterrupt):
        fresh_lab.run_cell(f"open({str(marker)!r}, 'w').close()\n"
                           f"if rank == 0:\n    dist.recv(torch.ones(1), src=1)", ranks=[0])
    assert "rank 0 did not stop on interrupt" in capsys.readouterr().out
    with pytest.raises(ddplab.DdplabError, match=r"lab.restart\(\)"):
        fresh_lab.run(print)


# 3. Rank failure -------------------------------------------------------------

def test_exception_while_others_wait_in_collective_is_reported_early(fresh_lab):
    begin = time.monotonic()
    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.run_cell("if rank == 1:\n    raise RuntimeError('boom on one')\n"
                           "dist.all_reduce(torch.ones(1))")
    assert time.monotonic() - begin < fresh_lab.spec.timeout / 3    # not at the lab's timeout
    assert list(info.value.failures) == [1]
    message = str(info.value)
    assert "RuntimeError: boom on one" in message
    assert "rank 0: still in all_reduce (cell line 3), waiting for the failed rank" in message
    assert message.endswith("Recover with: lab.restart()")


# 4. Engine death -------------------------------------------------------------

def test_killed_engine_is_named_on_next_call_and_restart_recovers(fresh_lab):
    victim = fresh_lab.pids[1]
    procs.send(victim, signal.SIGKILL)
    if alive(victim):                                 # SIGKILL lands asynchronously
        psutil.Process(victim).wait(5)
    begin = time.monotonic()
    with pytest.raises(ddplab.EngineDiedError,
                       match=r"engine of rank 1 was killed \(SIGKILL\).*lab.restart\(\)") as info:
        fresh_lab.run(print)
    assert time.monotonic() - begin < 2
    assert info.value.ranks == [1]
    fresh_lab.restart()
    assert fresh_lab.run(lambda: 2) == [2, 2]


def test_engine_killed_during_a_call_is_detected_at_once(fresh_lab, tmp_path):
    marker = tmp_path / "started"
    victim = fresh_lab.pids[0]
    _when_file_exists(marker, lambda: procs.send(victim, signal.SIGKILL))
    begin = time.monotonic()
    with pytest.raises(ddplab.EngineDiedError, match=r"engine of rank 0 was killed \(SIGKILL\)"):
        fresh_lab.run_cell(f"open({str(marker)!r}, 'w').close()\nimport time\ntime.sleep(60)")
    assert time.monotonic() - begin < 5


# 5. No orphans ---------------------------------------------------------------

# A stand-in for a notebook kernel: starts a lab, reports what it started,
# then waits on stdin ("wait") or ends without calling lab.stop() ("exit").
KERNEL_STAND_IN = """
import json, sys, psutil, ddplab
lab = ddplab.start(world_size=2, backend="gloo")
tree = [p.pid for p in psutil.Process().children(recursive=True)]
print("STARTED", json.dumps({"pids": tree, "dir": lab.directory}), flush=True)
if sys.argv[1] == "wait":
    sys.stdin.read()
"""


def _started(line: str) -> dict:
    return json.loads(line.split("STARTED ", 1)[1])


def _gone_within(started: dict, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (any(map(alive, started["pids"]))
                                           or os.path.exists(started["dir"])):
        time.sleep(0.05)
    assert [pid for pid in started["pids"] if alive(pid)] == []
    assert not os.path.exists(started["dir"])


def test_kernel_killed_with_sigkill_leaves_no_process_or_file():
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL_STAND_IN, "wait"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("STARTED"):
            line = kernel.stdout.readline()
            assert line, "the stand-in kernel exited before starting its lab"
    finally:
        procs.send(kernel, signal.SIGKILL)            # the kernel only: its lab must notice
        kernel.wait()
    started = _started(line)
    assert len(started["pids"]) >= 3                  # controller (+ schedulers) and 2 engines
    _gone_within(started, 10)


def test_script_that_never_calls_stop_leaves_nothing_behind():
    result = subprocess.run([sys.executable, "-c", KERNEL_STAND_IN, "exit"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    _gone_within(_started(result.stdout), 0)          # gone by the time the script has exited


# 6. Two labs at once ---------------------------------------------------------

# Each try, both processes wait at a file barrier, then start their labs at once.
TWO_LABS = """
import os, sys, time, ddplab
def total():
    import torch, torch.distributed as dist
    t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t); return t.item()
barrier, me, tries = sys.argv[1], sys.argv[2], int(sys.argv[3])
for attempt in range(tries):
    open(os.path.join(barrier, f"{attempt}-{me}"), "w").close()
    deadline = time.monotonic() + 60
    while len([f for f in os.listdir(barrier) if f.startswith(f"{attempt}-")]) < 2:
        assert time.monotonic() < deadline, f"the other process never reached try {attempt}"
        time.sleep(0.005)
    with ddplab.start(world_size=2, backend="gloo") as lab:
        assert lab.run(total) == [3.0, 3.0], f"try {attempt}"
print("ok")
"""


def test_two_labs_started_at_the_same_moment_never_clash(tmp_path):
    tries = 10
    stand_ins = [subprocess.Popen([sys.executable, "-c", TWO_LABS, str(tmp_path), name,
                                   str(tries)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
                 for name in ("a", "b")]
    try:
        # Both answers first: when one stand-in fails, the other only waits at
        # the barrier, and the failure worth reading is the first one's.
        outputs = [proc.communicate(timeout=tries * 30) for proc in stand_ins]
        failed = [f"stand-in {name} (exit {proc.returncode}):\n{err[-3000:]}"
                  for name, proc, (out, err) in zip("ab", stand_ins, outputs)
                  if proc.returncode != 0 or not out.strip().endswith("ok")]
        assert not failed, "\n".join(failed)
    finally:
        for proc in stand_ins:                        # never leave a stand-in running
            procs.end_tree(proc, grace=5)
            proc.wait()


def test_the_controller_listens_on_unix_sockets_in_the_lab_directory_only():
    """No TCP port to collide on or to reach: the controller's channels are files in the 0700 directory."""
    lab = side_lab(2)
    try:
        controller = psutil.Process(lab.controller_pid)
        tree = {controller.pid, *(p.pid for p in controller.children(recursive=True))}
        listening = [c for c in psutil.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in tree]
        assert listening == [], f"the controller listens on TCP: {listening}"
        sockets = [c.laddr for c in psutil.net_connections("unix")
                   if c.pid in tree and c.laddr.startswith(lab.directory + os.sep)]
        assert len(sockets) >= 10, f"expected the controller's channels in {lab.directory}"
        assert os.stat(lab.directory).st_mode & 0o777 == 0o700
    finally:
        lab.stop()
    assert not os.path.exists(lab.directory)


# 7. Security -----------------------------------------------------------------

def test_everything_listens_on_loopback_only(fresh_lab):
    """What the ranks open (gloo, a TCPStore) is on 127.0.0.1 of their own network, and
    nothing of the lab's listens on this machine's network at all (tests/test_isolation.py
    connects to them as another user)."""
    fresh_lab.run(lambda: __import__("torch.distributed").distributed.barrier())
    tree = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [c for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in tree]
    assert listening == [], f"reachable on this machine's network: {listening}"
    in_their_network = listening_addresses(fresh_lab.engines.pids[0])
    assert in_their_network, "expected gloo's sockets to listen in the ranks' network"
    assert {ip for ip, _ in in_their_network} == {"127.0.0.1"}


def test_connection_files_are_owner_only_and_messages_signed(fresh_lab):
    security = os.path.join(fresh_lab.directory, "security")
    # The connection files hold the signing key; the lab's directory, which
    # holds everything else too, is closed to other users as a whole.
    files = [os.path.join(security, name) for name in os.listdir(security)
             if name.startswith("ipcontroller-")]
    assert len(files) == 2                           # the engine's and the client's
    assert os.stat(fresh_lab.directory).st_mode & 0o077 == 0
    for path in files:
        assert os.stat(path).st_mode & 0o077 == 0, path
        with open(path) as f:
            info = json.load(f)
        assert info["key"] and info["signature_scheme"].startswith("hmac-")
    assert fresh_lab.engines.engine_set.client.session.key


# 8. Debug help ---------------------------------------------------------------

def test_debug_explains_a_mismatched_collective_per_rank():
    with ddplab.start(world_size=2, backend="gloo", debug=True) as lab:
        assert lab.run(lambda: os.environ["TORCH_DISTRIBUTED_DEBUG"]) == ["DETAIL", "DETAIL"]
        with pytest.raises(ddplab.RankError) as info:
            lab.run_cell("dist.all_reduce(torch.ones(rank + 1))")
    assert sorted(info.value.failures) == [0, 1]
    for trace in info.value.failures.values():
        assert "Detected mismatch between collectives" in trace
        assert "Tensor shapes" in trace

