"""How a rank's output is captured on the engine and shown in the kernel, on real engines."""

import time

import pytest

import ddplab
from ddplab.rank import live, output

pytestmark = pytest.mark.slow

LOOP = "for step in range({n}):\n    print(f'step {{step}} loss 0.1234')"


def test_100k_lines_finish_well_inside_the_timeout(fresh_lab, capsys):
    # Capture used to re-copy everything printed at each write: 100k lines took
    # 80 s and were reported as a deadlock. Linear capture takes about a second.
    timeout = fresh_lab.spec.timeout
    begin = time.monotonic()
    fresh_lab.run_cell(LOOP.format(n=100_000), timeout=timeout)
    took = time.monotonic() - begin
    assert took < timeout / 3, f"100k lines took {took:.1f} s of a {timeout:g} s timeout"
    out = capsys.readouterr().out
    assert out.startswith("[rank 0]\nstep 0 loss 0.1234\nstep 1 loss 0.1234\n")
    assert out.rstrip().endswith("step 99999 loss 0.1234")
    assert out.index("[rank 0]") < out.index("[rank 1]")
    assert out.count("step 99999 loss 0.1234") == 2


def test_a_flood_is_capped_with_a_note_keeping_head_and_tail(fresh_lab, capsys):
    timeout = fresh_lab.spec.timeout
    begin = time.monotonic()
    # About 50 MB on rank 0.
    fresh_lab.run_cell("if rank == 0:\n    line = 'x' * 99\n    for i in range(500_000):\n"
                       "        print(i, line)", timeout=timeout)
    took = time.monotonic() - begin
    assert took < timeout / 2, f"a 50 MB flood took {took:.1f} s of a {timeout:g} s timeout"
    out = capsys.readouterr().out
    assert out.startswith("[rank 0]\n0 " + "x" * 99 + "\n1 ")
    assert out.rstrip().endswith("499999 " + "x" * 99)
    assert "[rank 1]" not in out
    note = [line for line in out.splitlines() if line.startswith("[ddplab: output truncated")]
    assert len(note) == 1, note
    assert "lines (" in note[0] and "characters) dropped here" in note[0]
    assert len(out) < output.KEEP_HEAD + output.KEEP_TAIL + 1000
    # Every kept line is whole: the tail starts at a line's start.
    after = out.split(note[0] + "\n")[1]
    assert after.split("\n", 1)[0].endswith(" " + "x" * 99)


def test_recorder_keeps_order_of_streams_and_is_linear():
    recorder = output.OutputRecorder(head=10, tail=10)
    for chunk in ["aaaa\n", "bbbb\n", "cccc\n", "dddd\n", "eeee\n"]:
        recorder.text("stdout", chunk)
    recorder.text("stderr", "err\n")
    events = recorder.events
    assert events[0][0] == "stdout" and events[0][1].startswith("aaaa\nbbbb\n[ddplab: output truncated")
    assert events[0][1].endswith("characters]\neeee\n")
    assert events[1] == ("stderr", "err\n")
    small = output.OutputRecorder()
    small.text("stdout", "a")
    small.display({"text/plain": "1"}, None)
    small.text("stdout", "b")
    small.text("stdout", "c")
    assert small.events == [("stdout", "a"), ("display", {"text/plain": "1"}, {}), ("stdout", "bc")]


def test_a_hang_shows_what_the_stuck_rank_printed_first(fresh_lab, capsys):
    source = ("print(f'rank {rank} before the recv')\n"
              "if rank == 0:\n    dist.recv(torch.zeros(1), src=1)\n")
    with pytest.raises(ddplab.HangError) as info:
        fresh_lab.run_cell(source, timeout=3)
    out = capsys.readouterr().out
    assert out.startswith("[rank 0] (stuck; what it printed last, before the diagnosis below)\n"
                          "rank 0 before the recv\n[rank 1]\nrank 1 before the recv\n"), out
    assert "rank 0: still in recv" in str(info.value)


def test_live_screen_renders_carriage_returns():
    assert live.render("a\n 10%\r 20%\r 30%\nb\r") == "a\n 30%\nb"
    published = []
    pump = live.Pump(published.append)
    for i in range(5000):
        pump.chunks.append(f"line {i}\n")
    pump.publish()
    pump.publish()                     # nothing new: nothing sent
    assert len(published) == 1
    screen = published[0][live.KEY]
    assert screen.endswith("line 4999\n") and len(screen) <= live.SCREEN_CHARS


def test_a_trailing_semicolon_hides_the_value(fresh_lab, capsys):
    fresh_lab.run_cell("x = rank + 40\nx + 2;  # quiet, as in IPython")
    assert capsys.readouterr().out == ""
    fresh_lab.run_cell("x + 2")
    assert capsys.readouterr().out == "[rank 0]\n42\n[rank 1]\n43\n"
