"""VS Code's debugger on a rank through a real Jupyter kernel: ``%%ranks --debugpy`` and
``lab.debugpy``, attached to by a DAP client as VS Code would (tests/dapclient.py).

A kernel is started with jupyter_client, a lab in it, its cells run as a front end
runs them (tests/kernelkit.py). pdb at a rank's prompt: tests/test_debugger_pdb.py.
"""

from __future__ import annotations

import queue
import re
import time

import pytest
from kernelkit import Run, ok, run

pytestmark = pytest.mark.slow       # a kernel and a lab of its own: seconds per test


WORK = "def scale(n):\n    secret = n * 7\n    return secret + 1\n"
DEBUGPY_CELL = """%%ranks --debugpy 1
import sys
sys.path.insert(0, {folder!r})
import dbgwork
v = dbgwork.scale(rank + 5)
dist.barrier()
print('v', v)
"""


def test_vscode_attaches_to_rank_1_through_debugpy_and_nothing_listens_afterwards(k, tmp_path):
    # Issue 44: a real DAP client (what VS Code speaks) over the port ddplab reports.
    import socket


    (tmp_path / "dbgwork.py").write_text(WORK)
    ok(k, f"import os\n_here = os.getcwd()\nos.chdir({str(tmp_path)!r})")   # launch.json goes here
    msg_id = k.execute(DEBUGPY_CELL.format(folder=str(tmp_path)))
    seen = Run()

    def take(limit: float, until) -> bool:
        """Read iopub for the cell until ``until()``; True if the cell ended."""
        deadline = time.monotonic() + limit
        while not until():
            assert time.monotonic() < deadline, (seen.stdout, seen.statuses, seen.error)
            try:
                msg = k.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                seen.stdout += content["text"]
            elif kind in ("display_data", "update_display_data"):
                seen.statuses.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                seen.error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return True
        return False

    try:
        _drive_vscode_session(k, tmp_path, seen, take)
    except BaseException:
        k.interrupt()                                # the cell must not wait for a client forever
        take(60, lambda: False)
        raise
    with socket.socket() as probe:                   # nothing listens afterwards
        assert probe.connect_ex(("127.0.0.1", seen.port)) != 0, f"port {seen.port} still listens"
    assert ok(k, "import glob\nprint(glob.glob(os.path.join(lab.engines.directory, 'debugpy*')))\n"
                 "os.chdir(_here)") == "[]\n"
    assert ok(k, "%%ranks\ndist.barrier()\nprint(rank)") == "[rank 0]\n0\n[rank 1]\n1\n"
    # debugpy starts once per process: a second session on rank 1 says how to recover.
    seen = run(k, "%%rank 1 --debugpy\nprint(1)\n")
    assert "debugpy already ran on this rank" in seen.error and "lab.restart()" in seen.error, seen
    seen = run(k, "%%ranks --debugpy 7\nprint(1)\n")           # a bad rank number
    assert seen.error.startswith("ConfigError: ddplab: %%ranks --debugpy 7 names rank 7"), seen.error
    ok(k, "lab.restart()")


def _drive_vscode_session(k, tmp_path, seen, take) -> None:
    """Attach to rank 1 as VS Code would, stop at the breakpoint, read locals, continue."""
    import json
    import subprocess

    from dapclient import DapClient

    take(60, lambda: re.search(r"on 127\.0\.0\.1:(\d+)\n", seen.stdout) or seen.error)
    assert not seen.error, seen.error
    port = seen.port = int(re.search(r"ddplab: rank 1 waits for VS Code on 127\.0\.0\.1:(\d+)\n",
                                     seen.stdout)[1])
    assert "Run and Debug > 'ddplab: attach to ranks'" in seen.stdout, seen.stdout
    launch = json.loads((tmp_path / ".vscode" / "launch.json").read_text())
    assert launch["compounds"] == [{"name": "ddplab: attach to ranks",
                                    "configurations": ["ddplab: rank 1"]}]
    assert launch["configurations"][0]["connect"] == {"host": "127.0.0.1", "port": port}

    # Another user of the machine is refused: the connection closes before any DAP is read.
    other = subprocess.run(
        ["python3", "-c", "import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=20)\n"
         "s.sendall(b'Content-Length: 2\\r\\n\\r\\n{}')\ntry:\n    print(repr(s.recv(100)))\n"
         "except ConnectionResetError:\n    print('reset')" % port],
        user=65534, capture_output=True, text=True, timeout=30)
    assert other.stdout in ("b''\n", "reset\n"), (other.stdout, other.stderr)
    dap = DapClient("127.0.0.1", port)
    try:
        dap.request("initialize", adapterID="debugpy", clientID="ddplab-test", linesStartAt1=True,
                    columnsStartAt1=True, pathFormat="path")
        attach = dap.send("attach", justMyCode=False)
        placed = dap.request("setBreakpoints", source={"path": str(tmp_path / "dbgwork.py")},
                             breakpoints=[{"line": 3}])
        assert placed["breakpoints"][0]["verified"], placed
        dap.request("configurationDone")
        dap.response(attach)
        stopped = dap.wait_event("stopped")
        assert stopped["reason"] == "breakpoint", stopped
        top = dap.request("stackTrace", threadId=stopped["threadId"])["stackFrames"][0]
        assert (top["name"], top["line"]) == ("scale", 3), top
        scope = dap.request("scopes", frameId=top["id"])["scopes"][0]
        names = {v["name"]: v["value"] for v in
                 dap.request("variables", variablesReference=scope["variablesReference"])["variables"]}
        assert names["secret"] == "42" and names["n"] == "6", names        # rank 1: n = 1 + 5
        # Meanwhile rank 0 waits for rank 1 in the barrier, and the live status says so.
        take(20, lambda: any(s.startswith("[rank 0] (blocked in barrier, cell line 5)")
                             for s in seen.statuses))
        dap.request("continue", threadId=stopped["threadId"])
        assert take(60, lambda: False), seen.stdout
    finally:
        dap.close()
    assert not seen.error, seen.error
    assert seen.stdout.endswith("[rank 0]\nv 36\n[rank 1]\nv 43\n"), seen.stdout


def test_lab_debugpy_without_with_says_how_and_a_bad_rank_is_refused_at_once(k):
    out = ok(k, "lab.debugpy(ranks=1)\nprint('after')")
    assert out == ("ddplab: lab.debugpy(ranks=1) did nothing: it is a with-block, entered only by "
                   "`with`. Write\n    with lab.debugpy(ranks=[1]):\n        lab.run(fn)   # or any "
                   "calls to debug\nor run one cell under VS Code with %%ranks --debugpy 1.\n"
                   "after\n"), out
    seen = run(k, "block = lab.debugpy(ranks=7)")
    assert seen.error.startswith("ConfigError: ddplab: lab.debugpy(ranks=7) names rank 7"), seen.error
    assert ok(k, "%%ranks\nprint(rank)") == "[rank 0]\n0\n[rank 1]\n1\n"    # nothing listens


def _waits_in(directory: str, pid: int, rank: int, function: str, limit: float = 60) -> None:
    """Return once rank ``rank`` (process ``pid``) runs ``function``, read from its stack."""
    import os

    from ddplab.lab import diagnose

    deadline = time.monotonic() + limit
    stack_file = os.path.join(directory, f"stack-rank{rank}.txt")
    while time.monotonic() < deadline:
        dump = diagnose.dump_stack(pid, stack_file, time.monotonic() + 5)
        if any(f == function for _, _, f in diagnose.main_thread_stack(dump)):
            return
    raise AssertionError(f"rank {rank} never ran {function} in {limit} s")


def test_an_interrupt_while_waiting_for_vs_code_is_one_line(k, tmp_path):
    directory, pid = ok(k, "print(lab.engines.directory, lab.engines.pids[1])").split()
    ok(k, f"import os\n_here = os.getcwd()\nos.chdir({str(tmp_path)!r})")   # launch.json goes here
    msg_id = k.execute("%%rank 1 --debugpy\nprint('never')\n")
    stdout, error = "", None
    while True:
        msg = k.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            stdout += msg["content"]["text"]
            if "waits for VS Code" in stdout and error is None:
                # Interrupted once rank 1 waits for a client (an idle rank ignores a SIGINT).
                _waits_in(directory, int(pid), 1, "block_until_configuration_done")
                k.interrupt()                        # instead of attaching
                error = {}
        elif msg["msg_type"] == "error":
            error = msg["content"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert "ddplab: interrupted; the ranks stopped and the lab is usable." in stdout, stdout
    assert error["ename"] == "KeyboardInterrupt", error
    assert error["traceback"] == ["KeyboardInterrupt: the call was interrupted (what became of "
                                  "the ranks is said above)"], error["traceback"]
    ok(k, "os.chdir(_here)\nlab.restart()")        # debugpy starts once per rank process
