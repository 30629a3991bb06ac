"""pdb on a rank through a real Jupyter kernel: its prompts answered as a front end would.

A kernel is started with jupyter_client, a lab in it; cells run with
``allow_stdin=True`` and each ``input_request`` (the input box JupyterLab would
show) is answered on the stdin channel, while the iopub messages are read:
the pdb text the kernel prints, and the live status of the other ranks
(tests/kernelkit.py). VS Code's debugger (debugpy): tests/test_debugger_vscode.py.
"""

from __future__ import annotations

import queue
import re
import time

import pytest
from kernelkit import Run, ok, run, wait_for_status

pytestmark = pytest.mark.slow       # a kernel and a lab of its own: seconds per test


# Rank 1 stops before line 4; rank 0 goes on to the barrier (cell line 6) and waits there.
STOP_RANK_1 = """%%ranks
import ddplab
x = rank * 10 + 1
ddplab.breakpoint(rank=1)
y = x + 1
z = y * 2
dist.barrier()
print('z =', z)
"""


def test_stop_rank_1_print_step_list_continue_while_rank_0_waits(k):
    seen = run(k, STOP_RANK_1, ["p x", "n", "p y", "l", "c"],
               before_answer=wait_for_status(r"^\[rank 0\] \(blocked in barrier, cell line 6\)",
                                             r"^\[rank 1\] \(in the debugger\)"))
    assert not seen.error, seen.error
    assert seen.prompts == ["(Pdb rank 1) "] * 5
    # Where it stopped, then each answer, in the order typed.
    assert "-> y = x + 1" in seen.stdout
    assert "\n11\n" in seen.stdout                  # p x, on rank 1
    assert "-> z = y * 2" in seen.stdout             # n
    assert "\n12\n" in seen.stdout                   # p y
    assert "  6  \tdist.barrier()" in seen.stdout   # l lists the cell around the line
    # (Rank 1 shown in the debugger and rank 0 waiting for it in the barrier, while the
    # first prompt waited: wait_for_status failed the test otherwise.)
    # c: the cell finished normally, with the right values on both ranks.
    assert seen.stdout.endswith("[rank 0]\nz = 4\n[rank 1]\nz = 24\n"), seen.stdout


def test_q_ends_the_cell_with_a_clear_message_and_the_next_cell_works(k):
    seen = run(k, "%%rank 1 --pdb\na = 5\nb = a + 1\nprint('not reached')\n", ["n", "p a", "q"])
    assert seen.prompts == ["(Pdb rank 1) "] * 3
    assert "-> a = 5" in seen.stdout and "-> b = a + 1" in seen.stdout and "\n5\n" in seen.stdout
    assert seen.error.startswith("RankError"), seen.error
    assert "rank 1: you quit the debugger (q), so the cell stopped there" in seen.error
    assert "use c (continue)" in seen.error
    assert "not reached" not in seen.stdout
    assert ok(k, "%%ranks\nprint(rank * 3)") == "[rank 0]\n0\n[rank 1]\n3\n"


def test_q_while_another_rank_waits_in_a_collective_names_the_recovery(k):
    # pytorch#154563: the other rank is stranded in the barrier. ddplab says where it is
    # and the one call that frees it, and that call works.
    seen = run(k, "%%ranks\nimport ddplab\nddplab.breakpoint(rank=1)\nx = 1\ndist.barrier()\n", ["q"])
    assert "you quit the debugger (q)" in seen.error, seen.error
    assert "rank 0: still in barrier (cell line 4), waiting for the failed rank" in seen.error
    assert seen.error.endswith("Recover with: lab.restart()"), seen.error
    assert ok(k, "lab.restart()\nprint(lab.healthy)") == "True\n"
    assert ok(k, "%%ranks\ndist.barrier()\nprint(rank)") == "[rank 0]\n0\n[rank 1]\n1\n"


def test_two_ranks_at_breakpoints_are_served_one_at_a_time(k):
    seen = run(k, "%%ranks\nimport ddplab\nv = rank + 100\nddplab.breakpoint()\nw = v\nprint(w)\n",
               ["p v", "c", "p v", "c"])
    assert not seen.error, seen.error
    # Whichever rank got there first, its session ran to its c before the other's began.
    assert seen.prompts in (["(Pdb rank 0) "] * 2 + ["(Pdb rank 1) "] * 2,
                            ["(Pdb rank 1) "] * 2 + ["(Pdb rank 0) "] * 2), seen.prompts
    first, second = seen.prompts[0][len("(Pdb rank ")], seen.prompts[2][len("(Pdb rank ")]
    said = [line for line in seen.stdout.splitlines() if "stopped in the debugger" in line]
    assert [line.split()[2] for line in said] == [first, second], said
    # Each p v answered from its own rank: 100 on rank 0, 101 on rank 1, in serving order.
    values = [line for line in seen.stdout.splitlines() if line in ("100", "101")]
    assert values[:2] == [f"10{first}", f"10{second}"], seen.stdout
    assert seen.stdout.endswith("[rank 0]\n100\n[rank 1]\n101\n"), seen.stdout



def test_n_into_a_barrier_moves_on_to_the_rank_it_waits_for(k):
    # PR#118645's trap: n over a barrier on the first rank blocks it until the other,
    # at its own prompt, gets there. The kernel moves on to that rank instead of waiting.
    seen = run(k, "%%ranks\nimport ddplab\nddplab.breakpoint()\ndist.barrier()\nprint('past', rank)\n",
               ["n", "n", "c", "c"])
    assert not seen.error, seen.error
    a, b = seen.prompts[0], seen.prompts[1]
    assert a != b and seen.prompts == [a, b, b, a], seen.prompts
    first = a[len("(Pdb rank ")]
    assert f"ddplab: rank {first} is blocked in barrier, cell line 3, waiting for the other ranks" \
        in seen.stdout, seen.stdout
    assert seen.stdout.endswith("[rank 0]\npast 0\n[rank 1]\npast 1\n"), seen.stdout


FAILING = """%%ranks
def scale(n):
    secret = n * 7
    if rank == 1:
        raise ValueError('boom')
    return secret
scale(rank + 1)
"""


def test_ddplab_debug_after_a_rank_error_shows_the_ranks_local_variable(k):
    seen = run(k, FAILING)
    assert seen.error.startswith("RankError") and "ValueError: boom" in seen.error
    seen = run(k, "%ddplab_debug", ["p secret", "p n", "u", "p rank", "c"])
    assert not seen.error, seen.error
    assert seen.prompts == ["(Pdb rank 1) "] * 5
    assert "ValueError: boom\n> <rank cell" in seen.stdout
    assert "(4)scale()\n-> raise ValueError('boom')" in seen.stdout
    assert "\n14\n2\n" in seen.stdout.replace("\n> ", "\n")    # secret and n on rank 1
    assert "(6)<module>()\n-> scale(rank + 1)" in seen.stdout   # u: the cell's frame
    assert ok(k, "%%ranks\nprint('usable', rank)") == "[rank 0]\nusable 0\n[rank 1]\nusable 1\n"


def test_ddplab_debug_works_while_the_other_rank_is_stuck_waiting_for_the_failed_one(k):
    seen = run(k, "%%ranks\nt = torch.ones(2) * (rank + 1)\nif rank == 1:\n    bad = t.sum().item()\n"
                  "    raise RuntimeError('rank 1 fails')\ndist.all_reduce(t)\n")
    assert "rank 0: still in all_reduce (cell line 5)" in seen.error, seen.error
    seen = run(k, "%ddplab_debug", ["p bad", "c"])
    assert not seen.error, seen.error
    assert seen.prompts == ["(Pdb rank 1) "] * 2
    assert "\n4.0\n" in seen.stdout, seen.stdout
    assert seen.stdout.endswith("ddplab: the other ranks are still stuck waiting for the rank that "
                                "failed. Recover with: lab.restart()\n"), seen.stdout


def test_ddplab_debug_with_no_error_to_debug_says_what_to_do(k):
    ok(k, "lab.restart()")                   # a fresh lab: nothing has raised
    seen = run(k, "%ddplab_debug")
    assert seen.error.startswith("ConfigError: ddplab: no rank has raised yet"), seen.error
    assert "ddplab.breakpoint()" in seen.error


def test_with_no_input_box_a_breakpoint_continues(k):
    # nbval and the grader send cells without allow_stdin: the notebook must run to its end.
    seen = run(k, "%%rank 1\nimport ddplab\nddplab.breakpoint()\nprint('went on')\n",
               allow_stdin=False)
    assert not seen.error and not seen.prompts, seen
    assert seen.stdout == ("ddplab: rank 1 stopped in the debugger, but this front end cannot "
                           "answer a prompt (no stdin, as under nbval or a grader): it continues "
                           "(c).\n[rank 1]\nwent on\n")


STEP_IN = """%%rank 1 --timeout 1 --pdb
def double(q):
    r = q * 2
    return r
y = double(21)
print(y)
"""


def test_s_steps_into_the_cells_function_and_the_timeout_waits_for_the_user(k):
    def think(seen: Run, client) -> None:
        """The user thinks at the first prompt for longer than the cell's timeout."""
        if len(seen.prompts) == 1:
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                try:
                    seen.take(client.get_iopub_msg(timeout=0.1))
                except queue.Empty:
                    pass

    seen = run(k, STEP_IN, ["n", "s", "n", "p q", "n", "p r", "c"], before_answer=think)
    assert not seen.error, seen.error                # no HangError after timeout=1
    assert "-> y = double(21)" in seen.stdout
    assert "--Call--\n> <rank cell" in seen.stdout and "(1)double()" in seen.stdout   # s
    assert "(2)double()\n-> r = q * 2" in seen.stdout
    assert "\n21\n" in seen.stdout and "\n42\n" in seen.stdout                        # p q, p r
    assert seen.stdout.endswith("[rank 1]\n42\n"), seen.stdout


def test_kernel_interrupt_at_a_prompt_ends_the_cell_and_the_lab_stays_usable(k):
    msg_id = k.execute("%%ranks\nimport ddplab\nddplab.breakpoint(rank=1)\nx = 1\n", allow_stdin=True)
    assert k.get_stdin_msg(timeout=30)["content"]["prompt"] == "(Pdb rank 1) "
    k.interrupt()                                     # instead of answering
    stdout, error = "", ""
    while True:
        msg = k.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            stdout += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            error = msg["content"]["ename"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert error == "KeyboardInterrupt", (error, stdout)
    assert "ddplab: interrupted; the ranks stopped and the lab is usable." in stdout, stdout
    assert ok(k, "%%ranks\nprint(rank)") == "[rank 0]\n0\n[rank 1]\n1\n"


def test_ranks_pdb_serves_both_ranks_in_turn_each_prompt_naming_its_rank(k):
    seen = run(k, "%%ranks --pdb\nv = rank + 7\nw = v * 2\nprint(w)\n",
               ["n", "p v", "c", "n", "p v", "c"])
    assert not seen.error, seen.error
    # Both ranks stop at the cell's first line; one rank's session runs to its c, then the other's.
    a, b = seen.prompts[0], seen.prompts[3]
    assert {a, b} == {"(Pdb rank 0) ", "(Pdb rank 1) "} and seen.prompts == [a] * 3 + [b] * 3, \
        seen.prompts
    first, second = a[len("(Pdb rank ")], b[len("(Pdb rank ")]
    said = [line for line in seen.stdout.splitlines() if "stopped in the debugger" in line]
    assert [line.split()[2] for line in said] == [first, second], said
    assert seen.stdout.count("-> v = rank + 7") == 2 and seen.stdout.count("-> w = v * 2") == 2
    values = [line for line in seen.stdout.splitlines() if line in ("7", "8")]
    assert values == [str(7 + int(first)), str(7 + int(second))], seen.stdout    # p v, per rank
    assert seen.stdout.endswith("[rank 0]\n14\n[rank 1]\n16\n"), seen.stdout


GIVEN = """%%ranks
import ddplab
x = rank * 10 + 1
ddplab.breakpoint(rank=1, commands={commands})
y = x + 1
print('y =', y)
"""


def test_commands_given_up_front_run_with_no_input_box_and_are_shown_as_typed(k):
    # How a notebook run unattended (nbval, a grader) shows a real session.
    seen = run(k, GIVEN.format(commands=["p x", "n", "p y", "c"]), allow_stdin=False)
    assert not seen.error and not seen.prompts, seen
    cell = re.search(r"> (<rank cell \d+>)\(4\)<module>\(\)", seen.stdout)
    assert cell, seen.stdout
    assert seen.stdout == (
        "ddplab: rank 1 stopped in the debugger (n next line, s step in, p x print x, l list, "
        "c continue, q stop the cell).\n"
        f"> {cell[1]}(4)<module>()\n-> y = x + 1\n"
        "(Pdb rank 1) p x\n11\n"
        "(Pdb rank 1) n\n"
        f"> {cell[1]}(5)<module>()\n-> print('y =', y)\n"
        "(Pdb rank 1) p y\n12\n"
        "(Pdb rank 1) c\n"
        "[rank 0]\ny = 2\n[rank 1]\ny = 12\n"), seen.stdout


def test_when_the_given_commands_run_out_the_prompt_asks(k):
    seen = run(k, GIVEN.format(commands=["p x", "n"]), ["p y", "c"])
    assert not seen.error, seen.error
    assert seen.prompts == ["(Pdb rank 1) "] * 2       # only after the given ones
    assert "(Pdb rank 1) p x\n11\n(Pdb rank 1) n\n" in seen.stdout, seen.stdout
    assert "\n12\n" in seen.stdout and seen.stdout.endswith("[rank 1]\ny = 12\n"), seen.stdout


def test_commands_must_be_a_list_of_lines():
    import ddplab
    with pytest.raises(TypeError, match=r"commands must be a list of pdb command lines.*"
                                        r"commands=\['p x'\]"):
        ddplab.breakpoint(commands="p x")


def test_n_into_a_barrier_no_other_rank_reaches_ends_with_the_hang_report_at_the_timeout(k):
    # Issue 42: the cell never ended (the whole wait counted as the user's), and the live
    # area said "in the debugger" while the rank was blocked in the barrier.
    began = time.monotonic()
    seen = run(k, "%%rank 0 --pdb --timeout 3\nx = 1\ndist.barrier()\nprint('never')\n", ["n", "n"],
               limit=60)
    took = time.monotonic() - began
    assert seen.error.startswith("HangError"), seen.error
    assert "did not finish within timeout=3 s" in seen.error, seen.error
    assert "rank 0: still in barrier (cell line 2)" in seen.error, seen.error
    assert any(re.search(r"^\[rank 0\] \(blocked in barrier, cell line 2\)", s)
               for s in seen.statuses), seen.statuses
    assert took < 3 * 8, took                        # the timeout, plus the report's own seconds
    assert "never" not in seen.stdout
    ok(k, "lab.restart()")


def test_builtin_breakpoint_and_pdb_set_trace_are_the_ranks_debugger(k):
    seen = run(k, "%%rank 1\nx = 5\nbreakpoint()\ny = x + 1\nimport pdb\npdb.set_trace()\n"
                  "print('y', y)\n", ["p x", "c", "p y", "c"])
    assert not seen.error, seen.error                # not "you quit the debugger (q)"
    assert seen.prompts == ["(Pdb rank 1) "] * 4
    assert "-> y = x + 1" in seen.stdout and "\n5\n" in seen.stdout
    assert "-> print('y', y)" in seen.stdout and "\n6\n" in seen.stdout
    assert seen.stdout.endswith("[rank 1]\ny 6\n"), seen.stdout


def test_in_a_function_given_to_lab_run_l_shows_its_source_and_where_only_the_users_frames(k):
    ok(k, "def grow(a):\n    b = a + 1\n    ddplab.breakpoint(rank=1)\n    return b * 2\n")
    seen = run(k, "print(lab.run(grow, 3))", ["l", "where", "interact", "c"])
    assert not seen.error, seen.error
    # l: the function's cell, from the kernel's linecache (was a bare [EOF]).
    assert ("  1  \tdef grow(a):\n  2  \t    b = a + 1\n  3  \t    ddplab.breakpoint(rank=1)\n"
            "  4  ->\t    return b * 2\n[EOF]") in seen.stdout, seen.stdout
    # where: the function's frame alone, not ~30 of ipyparallel's and ddplab's.
    stack = seen.stdout.split("[EOF]\n")[1].split("ddplab: interact")[0]
    assert re.fullmatch(r"> \S+\(4\)grow\(\)\n-> return b \* 2\n", stack), stack
    assert "ddplab: interact is not available on a rank" in seen.stdout
    assert seen.stdout.endswith("[8, 8]\n"), seen.stdout


def test_debugging_a_rank_whose_last_error_is_an_earlier_cells_says_which(k):
    assert run(k, "%%ranks\nraise ValueError(f'first on {rank}')").error.startswith("RankError")
    later = run(k, "%%ranks\nif rank == 1:\n    raise KeyError('second')\n")
    assert later.error.startswith("RankError"), later.error
    seen = run(k, "lab.debug(rank=0)", ["c"])
    assert not seen.error, seen.error
    said = re.search(r"ddplab: rank 0 did not raise in the last call that failed \(rank 1 did, "
                     r"cell In \[(\d+)\], at \d\d:\d\d:\d\d\)\. The error below is rank 0's own "
                     r"last one, from an earlier call: cell In \[(\d+)\], at \d\d:\d\d:\d\d\.\n",
                     seen.stdout)
    assert said and int(said[2]) == int(said[1]) - 1, seen.stdout
    assert "ValueError: first on 0" in seen.stdout
    seen = run(k, "lab.debug(rank=1)", ["c"])         # the last failure's own rank: nothing to add
    assert "did not raise" not in seen.stdout and "KeyError: 'second'" in seen.stdout
