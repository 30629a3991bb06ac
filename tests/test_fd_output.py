"""Output that bypasses Python's sys.stdout (fd 1 and 2) reaches the rank's cell output.

Subprocesses, ``os.write`` and C++ logging (c10d's warnings) write straight to
the file descriptors; ``ddplab.rank.fdcapture`` routes them into the same
recorder as ``print``, so they appear under the rank's label, in rank order.
"""

import os
import sys
import time

import pytest

from ddplab.rank import output

pytestmark = pytest.mark.slow


@pytest.fixture
def merged(monkeypatch, capsys):
    """capsys, where the test first calls ``merged.start()``: stderr then goes into stdout,
    so one string shows the order of both (pytest resets sys.stderr as the test starts)."""
    capsys.start = lambda: monkeypatch.setattr(sys, "stderr", sys.stdout)
    return capsys


def test_subprocess_and_os_write_appear_under_each_rank_and_keep_their_order(fresh_lab, merged):
    merged.start()
    source = ("import os, subprocess\n"
              "print(f'before {rank}')\n"
              "subprocess.run(['echo', f'echo from {rank}'])\n"
              "os.write(1, f'fd1 from {rank}\\n'.encode())\n"
              "os.write(2, f'fd2 from {rank}\\n'.encode())\n"
              "print(f'after {rank}')\n"
              "os.write(1, f'last fd1 from {rank}'.encode());  # no newline, at the very end")
    for _ in range(3):
        fresh_lab.run_cell(source)
        out = merged.readouterr().out
        head, rank1 = out.split("[rank 1]\n")
        assert head.startswith("[rank 0]\n"), out
        for rank, text in ((0, head), (1, rank1)):
            lines = text.splitlines()
            # Where fd-level text lands among prints is a race (see fdcapture);
            # each kind keeps its own order, everything shows, the tail included.
            assert sorted(x for x in lines if "from" in x) == [
                f"echo from {rank}", f"fd1 from {rank}", f"fd2 from {rank}",
                f"last fd1 from {rank}"], out
            assert [x for x in lines if "before" in x or "after" in x] == [
                f"before {rank}", f"after {rank}"], out
            stdout_fd = [x for x in lines if x.startswith(("echo", "fd1", "last"))]
            assert stdout_fd == [f"echo from {rank}", f"fd1 from {rank}",
                                 f"last fd1 from {rank}"], out
            # "last fd1" (no newline, written last) shows: the end of a cell drains the pipes.


def test_a_cell_with_only_fd_output_shows_it_in_rank_order(fresh_lab, capsys):
    fresh_lab.run_cell("import os, subprocess\n"
                       "subprocess.run(['sh', '-c', f'echo out {rank}; echo err {rank} >&2']);")
    captured = capsys.readouterr()
    assert captured.out == "[rank 0]\nout 0\n[rank 1]\nout 1\n"
    assert captured.err == "err 0\nerr 1\n"


def test_a_real_c10d_warning_from_cpp_appears_under_its_rank(fresh_lab, merged):
    merged.start()
    # A TCPStore client with nobody listening: c10d's C++ code logs its
    # retries to fd 2 (c10 logging, not Python's warnings), then raises.
    source = ("import datetime, socket\n"
              "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
              "try:\n"
              "    dist.TCPStore('127.0.0.1', port, 2, is_master=False,\n"
              "                  timeout=datetime.timedelta(seconds=1))\n"
              "except Exception as e:\n"
              "    print(f'rank {rank} raised {type(e).__name__}')\n")
    fresh_lab.run_cell(source, timeout=fresh_lab.spec.timeout)
    out = merged.readouterr().out
    head, rank1 = out.split("[rank 1]\n")
    assert head.startswith("[rank 0]\n")
    for rank, text in ((0, head), (1, rank1)):
        assert "[c10d] The client socket has timed out" in text, out
        assert f"rank {rank} raised DistNetworkError" in text, out
        # the C++ log lines came before the print that followed the call
        assert text.index("[c10d]") < text.index(f"rank {rank} raised"), out


def test_an_fd_flood_is_capped_with_a_note_keeping_head_and_tail(fresh_lab, capsys):
    timeout = fresh_lab.spec.timeout
    begin = time.monotonic()
    # About 50 MB on rank 0, by os.write: 50 writes of 10,000 lines of 100 bytes.
    fresh_lab.run_cell("import os\nif rank == 0:\n    for block in range(50):\n"
                       "        os.write(1, ''.join(f'{block * 10_000 + i:>9} ' + 'x' * 89 + '\\n'\n"
                       "                            for i in range(10_000)).encode())\n",
                       timeout=timeout)
    took = time.monotonic() - begin
    assert took < timeout / 2, f"a 50 MB fd flood took {took:.1f} s of a {timeout:g} s timeout"
    out = capsys.readouterr().out
    assert out.startswith("[rank 0]\n        0 " + "x" * 89 + "\n        1 ")
    assert out.rstrip().endswith("   499999 " + "x" * 89)
    assert "[rank 1]" not in out
    note = [line for line in out.splitlines() if line.startswith("[ddplab: output truncated")]
    assert len(note) == 1, note
    assert len(out) < output.KEEP_HEAD + output.KEEP_TAIL + 1000


def _wait_for(path, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{what}: {path} did not appear within {timeout:g} s"
        time.sleep(0.02)


def test_output_written_between_cells_opens_the_next_cell(fresh_lab, tmp_path, merged):
    merged.start()
    go, done = tmp_path / "go", tmp_path / "done"
    fresh_lab.run_cell(
        "import os, threading, time\n"
        "def late():\n"
        f"    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.02)\n"
        "    print(f'late print {rank}')\n"
        "    os.write(2, f'late fd2 {rank}\\n'.encode())\n"
        f"    open({str(done)!r} + str(rank), 'w').close()\n"
        "threading.Thread(target=late, daemon=True).start()")
    assert merged.readouterr().out == ""
    go.touch()                        # the cell has ended: the threads write now
    for rank in (0, 1):
        _wait_for(f"{done}{rank}", f"rank {rank}'s thread", fresh_lab.spec.timeout)
    fresh_lab.run_cell("print(f'cell 2 on {rank}')")
    assert merged.readouterr().out == "".join(
        f"[rank {r}]\n{output.BETWEEN_CELLS_NOTE}late print {r}\nlate fd2 {r}\ncell 2 on {r}\n"
        for r in (0, 1))
    fresh_lab.run_cell("print('cell 3')")        # told once, then gone
    assert merged.readouterr().out == "[rank 0]\ncell 3\n[rank 1]\ncell 3\n"


def test_a_background_thread_print_carries_its_rank_label(fresh_lab, capsys):
    fresh_lab.run_cell("import threading\n"
                       "worker = threading.Thread(target=lambda: print(f'from a thread on {rank}'))\n"
                       "worker.start(); worker.join()")
    assert capsys.readouterr().out == ("[rank 0]\nfrom a thread on 0\n"
                                       "[rank 1]\nfrom a thread on 1\n")


def test_a_subprocess_given_sys_stdout_writes_into_the_rank_output(fresh_lab, merged):
    merged.start()
    # sys.stdout.fileno() is fd 1, captured: C-level writers that ask for it work.
    fresh_lab.run_cell("import subprocess, sys\n"
                       "subprocess.run(['echo', f'via fileno {rank}'], stdout=sys.stdout);")
    assert merged.readouterr().out == "[rank 0]\nvia fileno 0\n[rank 1]\nvia fileno 1\n"


def test_recorder_takes_writes_larger_than_its_tail_and_absorbs_an_inbox():
    # fd-level text arrives in chunks of up to a megabyte: one write can be
    # larger than the whole tail (this raised IndexError before).
    recorder = output.OutputRecorder(head=10, tail=10)
    recorder.text("stdout", "head\n")
    recorder.text("stdout", "".join(f"{i:03}\n" for i in range(100)))
    events = recorder.events
    assert events[0][1].startswith("head\n000\n0\n[ddplab: output truncated")
    assert events[0][1].endswith("characters]\n098\n099\n")
    inbox = output.OutputRecorder(head=4, tail=4)
    inbox.text("stderr", "".join(f"e{i}\n" for i in range(10)))
    target = output.OutputRecorder()
    target.text("stdout", "before\n")
    target.absorb(inbox)
    target.text("stdout", "after\n")
    kinds = [e[0] for e in target.events]
    assert kinds == ["stdout", "stderr", "stdout"], target.events
    assert target.dropped_chars == inbox.dropped_chars > 0
