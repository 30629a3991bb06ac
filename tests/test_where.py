"""ddplab.rank.where: which call a rank is in and which line of the user's made it, in one wording.

Stacks here are recorded, not live: ``(filename, line, function)`` records as a
faulthandler dump lists them (the hang report), or as the live status and the
trace read them off the rank's frames. The first ones are a real dump's
frames: two gloo ranks, rank 0 waiting in a cell for rank 1 (see
``_dump``). So the fast tier checks, word for word, what a student reads in a
HangError, in the live status and in a trace.
"""

from __future__ import annotations

import sys

import pytest

from ddplab.lab import diagnose
from ddplab.rank import engine, where

SITE = "/home/student/.venv/lib/python3.11/site-packages"
C10D = f"{SITE}/torch/distributed/distributed_c10d.py"
LOGGER = f"{SITE}/torch/distributed/c10d_logger.py"
# What lies below a cell on an engine: ddplab's run_cell, then ipyparallel and ipykernel.
ENGINE = [(f"{SITE}/ddplab/rank/engine.py", 244, "run_cell"),
          (f"{SITE}/ipyparallel/engine/kernel.py", 170, "do_apply"),
          (f"{SITE}/ipykernel/kernelbase.py", 437, "dispatch_shell"),
          ("/usr/lib/python3.11/asyncio/events.py", 84, "_run"),
          ("<frozen runpy>", 88, "_run_code")]
RUN_FN = [(f"{SITE}/ddplab/rank/engine.py", 258, "call")] + ENGINE[1:]
KERNEL_FN = "/tmp/ipykernel_4242/1234567.py"       # a function the notebook defined


def _dump(frames: list[tuple[str, int, str]]) -> str:
    """The text faulthandler writes for these frames (innermost first), with a side thread."""
    lines = ["Thread 0x00007f1e2b7fe640 (most recent call first):",
             f'  File "{SITE}/ddplab/rank/live.py", line 181 in _run',
             '  File "/usr/lib/python3.11/threading.py", line 975 in run',
             "", "Current thread 0x00007f1e3c9a1b80 (most recent call first):"]
    lines += [f'  File "{path}", line {line} in {func}' for path, line, func in frames]
    return "\n".join(lines) + "\n"


def _hang_line(rank: int, frames: list[tuple[str, int, str]]) -> str:
    """A HangError's line for a still-running rank, as the lab writes it around ``where()``."""
    return f"  rank {rank}: still {diagnose.where(diagnose.main_thread_stack(_dump(frames)))}"


# ------------------------------------------------------------ recorded stacks
ALL_REDUCE = [(C10D, 3252, "all_reduce"), (LOGGER, 83, "wrapper"),
              ("<rank cell 4>", 3, "<module>")] + ENGINE
RECV_OBJECT_LIST = [(C10D, 2799, "recv"), (LOGGER, 83, "wrapper"),
                    (C10D, 3888, "recv_object_list"), (LOGGER, 83, "wrapper"),
                    ("<rank cell 4>", 3, "<module>")] + ENGINE
INIT = [(f"{SITE}/torch/distributed/rendezvous.py", 189, "_create_c10d_store"),
        (C10D, 2169, "_new_process_group_helper"), (C10D, 1899, "init_process_group"),
        (LOGGER, 97, "wrapper"), (LOGGER, 83, "wrapper"), ("<rank cell 2>", 2, "<module>")] + ENGINE
SEND_IN_FUNCTION = [(C10D, 2740, "send"), (LOGGER, 83, "wrapper"),
                    (KERNEL_FN, 12, "fn")] + RUN_FN
HELPER = "/home/student/course/helpers.py"
SEND_IN_HELPER = [(C10D, 2740, "send"), (LOGGER, 83, "wrapper"), (HELPER, 7, "pass_along"),
                  ("<rank cell 9>", 2, "<module>")] + ENGINE
BUSY_IN_CELL = [("<rank cell 5>", 2, "<module>")] + ENGINE            # in time.sleep: C, no frame
BUSY_IN_FUNCTION = [(HELPER, 5, "crunch"), (KERNEL_FN, 3, "train")] + RUN_FN


def test_a_cell_in_all_reduce_reads_the_same_in_the_hang_report_the_live_status_and_the_trace():
    found = where.locate(ALL_REDUCE)
    assert _hang_line(0, ALL_REDUCE) == "  rank 0: still in all_reduce (cell line 3)"
    assert found.blocked() == "blocked in all_reduce, cell line 3"
    assert found.line == "cell line 3"                           # a trace event's site
    assert diagnose.activity(ALL_REDUCE) == (True, "in all_reduce (cell line 3)")


def test_a_call_that_waits_inside_another_is_named_by_the_call_the_user_made():
    assert _hang_line(1, RECV_OBJECT_LIST) == "  rank 1: still in recv_object_list (cell line 3)"
    assert where.locate(RECV_OBJECT_LIST).blocked() == "blocked in recv_object_list, cell line 3"


def test_a_rank_waiting_for_the_group_to_fill_is_in_init_process_group():
    line = diagnose.where(INIT)
    assert line == "in init_process_group (cell line 2)"
    assert diagnose.waiting_to_join(line)
    assert not diagnose.waiting_to_join(diagnose.where(ALL_REDUCE))
    # ddplab's own join_group made the call: no line of the user's to name.
    joining = INIT[:5] + [(f"{SITE}/ddplab/rank/engine.py", 170, "join_group")] + RUN_FN[1:]
    assert diagnose.where(joining) == "in init_process_group"


def test_a_function_given_to_lab_run_is_named_by_its_function_and_line():
    found = where.locate(SEND_IN_FUNCTION)
    assert _hang_line(0, SEND_IN_FUNCTION) == "  rank 0: still in send (fn line 12)"
    assert found.blocked() == "blocked in send, fn line 12"
    assert found.line == "fn line 12"


def test_the_cell_line_wins_over_a_helper_module_the_cell_called():
    assert diagnose.where(SEND_IN_HELPER) == "in send (cell line 2)"
    stack = diagnose.format_stack(SEND_IN_HELPER)
    assert stack.splitlines()[0] == '    File "<rank cell 9>", line 2, in <module>'
    assert f'File "{HELPER}", line 7, in pass_along' in stack
    assert "run_cell" not in stack                  # ddplab's and the engine's frames stay out


def test_a_rank_busy_in_its_own_code_is_at_a_line_not_in_a_call():
    assert diagnose.activity(BUSY_IN_CELL) == (False, "at cell line 2")
    # No cell: the innermost frame of the user's own code, here a helper module's.
    assert diagnose.activity(BUSY_IN_FUNCTION) == (False, "at crunch line 5")
    assert where.locate(BUSY_IN_CELL).blocked() == ""


def test_code_at_module_level_is_named_by_its_file():
    script = [(C10D, 3252, "all_reduce"), (LOGGER, 83, "wrapper"),
              ("/home/student/train.py", 14, "<module>")]
    assert diagnose.where(script) == "in all_reduce (train.py line 14)"


def test_a_launcher_outside_the_users_code_is_not_the_call():
    """Under torchrun the stack's outer end is torch.distributed too: the call is the inner one."""
    launched = [(C10D, 3252, "all_reduce"), (LOGGER, 83, "wrapper"),
                ("/home/student/train.py", 20, "step"),
                (f"{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", 355,
                 "wrapper"),
                (f"{SITE}/torch/distributed/run.py", 900, "main")]
    assert diagnose.where(launched) == "in all_reduce (step line 20)"


def test_waiting_in_torch_distributed_outside_the_public_functions_still_counts_as_a_call():
    """DDP's constructor checks the parameters' shapes across ranks from a private helper."""
    ddp = [(f"{SITE}/torch/distributed/utils.py", 286, "_verify_param_shape_across_processes"),
           (f"{SITE}/torch/nn/parallel/distributed.py", 835, "__init__"),
           ("<rank cell 6>", 5, "<module>")] + ENGINE
    assert diagnose.activity(ddp) == (True, "in _verify_param_shape_across_processes (cell line 5)")
    assert where.locate(ddp).blocked() == ""      # the live status names public calls only


def test_no_stack_at_all_says_so():
    assert diagnose.where([]) == "somewhere (no stack could be read)"
    assert diagnose.activity([]) == (False, "somewhere (no stack could be read)")
    assert diagnose.format_stack([]) == ""


def test_a_long_stack_keeps_the_users_line_and_the_innermost_frames():
    deep = [(C10D, 100 + i, f"_inner{i}") for i in range(12)] + ALL_REDUCE
    lines = diagnose.format_stack(deep, limit=5).splitlines()
    assert lines[0] == '    File "<rank cell 4>", line 3, in <module>'
    assert lines[1] == "    ..."
    assert lines[-1] == '    File "torch/distributed/distributed_c10d.py", line 100, in _inner0'
    assert len(lines) == 6


@pytest.mark.parametrize(("path", "user"), [
    ("/home/student/course/helpers.py", True),
    ("/home/student/ddplab/notebooks/helpers.py", True),       # a folder named ddplab: theirs
    ("/opt/other/checkout/ddplab/rank/engine.py", False),      # ddplab, wherever it lies
    (f"{SITE}/numpy/core/fromnumeric.py", False),
    ("/usr/lib/python3.11/threading.py", False),
    ("<frozen runpy>", False),
    ("<rank cell 3>", True),
])
def test_users_code_is_what_no_library_owns(path, user):
    assert where.is_user_code(path) is user


def test_engine_names_cells_with_the_one_prefix():
    assert engine.CELL_FILENAME is where.CELL_FILENAME
    assert where.CELL_FILENAME.format(n=12).startswith(where.CELL_PREFIX)
    assert where.locate([(where.CELL_FILENAME.format(n=12), 4, "<module>")]).line == "cell line 4"


def test_live_frames_read_as_their_records():
    """``records(frame)`` defers each line number to the frame; the answer reads the real one."""
    names: dict = {}
    exec(compile("def send(probe):\n    return probe()\n", C10D, "exec"), names)
    exec(compile("def cell(send, probe):\n    x = 1\n    return send(probe)\n",
                 where.CELL_FILENAME.format(n=3), "exec"), names)
    found = names["cell"](names["send"], lambda: where.locate(where.records(sys._getframe(1))))
    assert found.blocked() == "blocked in send, cell line 3"
    assert found.call_at == 0 and found.line_at == 1


def _compiled(source: str, filename: str, names: dict) -> dict:
    exec(compile(source, filename, "exec"), names)
    return names


def test_live_site_answers_as_locate_does_as_callers_move_on():
    """``LiveSite`` keeps the answer for the frames beyond the user's caller; it must
    still say each call's own line when the cell further out moves to another line,
    when the caller is a new call of the same function, and for a generator."""
    live = where.LiveSite()
    answers = []

    def probe():
        frame = sys._getframe(1)                       # the "send" frame, innermost
        found = where.locate(where.records(frame))
        answers.append((live.site(frame), (found.line or None, found.call)))

    names = _compiled("def send(probe):\n    probe()\n", C10D, {})
    _compiled("def pass_along(send, probe):\n    send(probe)\n", HELPER, names)
    _compiled("def fn(n):\n    for _ in range(n):\n        pass_along(send, probe)\n"
              "def gen():\n    while True:\n        yield pass_along(send, probe)\n",
              KERNEL_FN, names)
    names["probe"] = probe
    _compiled("def cell():\n    fn(2)\n    fn(1)\n    g = gen()\n    next(g)\n    next(g)\n",
              where.CELL_FILENAME.format(n=7), names)
    names["cell"]()
    names["fn"](2)                                     # no cell on the stack: the helper's line
    assert [mine for mine, _ in answers] == [theirs for _, theirs in answers]
    assert [line for (line, _), _ in answers] == ["cell line 2"] * 2 + ["cell line 3"] + \
        ["cell line 5", "cell line 6"] + ["pass_along line 2"] * 2
    assert {call for (_, call), _ in answers} == {"send"}
    live.forget()
    assert live.kept == (None, "")


@pytest.mark.parametrize("text", [
    'File "/usr/lib/python3/site-packages/torch/x.py", line 3',
    "at /a/site-packages/b/site-packages/c.py and /opt/venv/lib/site-packages/d.py",
    "site-packages/e.py starts the text; 'quoted /q/site-packages/f.py'",
    "no path here at all",
    "\t/x/site-packages/\n",
])
def test_site_packages_paths_are_cut_as_the_pattern_cut_them(text):
    import re

    pattern = re.compile(r'[^"\s]*?site-packages/')     # the old cut, the meaning kept
    assert engine.relative_to_site_packages(text) == pattern.sub("", text)


def test_a_huge_one_word_message_is_formatted_in_one_pass():
    """A 4 MB token: the old pattern retried from every position (quadratic: it never ended)."""
    word = "x" * 4_000_000
    assert engine.relative_to_site_packages(f"ValueError: {word}/site-packages/y") == "ValueError: y"
    assert engine.relative_to_site_packages(word) == word


@pytest.mark.parametrize(("innermost", "busy"), [
    ('File "<rank cell 3>", line 2, in <module>', True),                 # a cell spinning
    (f'File "{KERNEL_FN}", line 6, in f', True),                          # lab.run(f): f sleeping
    ('File "/home/student/course/helpers.py", line 9, in load_batch', True),  # their module
    ('File "torch/distributed/distributed_c10d.py", line 3252, in all_reduce', False),
    ('File "torch/autograd/graph.py", line 829, in _engine_run_backward', False),  # DDP may wait
    ('File "/usr/lib/python3.11/threading.py", line 320, in wait', False),  # a queue: may wait
])
def test_a_rank_is_busy_in_its_own_code_when_its_innermost_frame_is_the_users(innermost, busy):
    """Hang reports tell a slow rank from a deadlock by this (issue 42): a function given to
    lab.run, or a helper module, counts as the user's code as a cell does. Stacks come with
    site-packages paths cut short, so a relative path is a library's."""
    stack = f'    File "<rank cell 1>", line 4, in <module>\n    {innermost}\n'
    assert diagnose.busy_in_own_code(stack) is busy
    assert diagnose.busy_in_own_code("") is False


def test_a_call_from_a_thread_with_no_python_stack_finds_the_main_threads_line():
    """A GPU's backward runs on autograd's device thread, which starts in C++: the recorder
    asks for 3 frames up a stack that has fewer (it raised ValueError on an H200, issue 60)."""
    import _thread
    import threading

    from ddplab.rank.recorder import CallRecorder

    recorder = CallRecorder()
    answers: list = []
    done = threading.Event()

    def shallow() -> None:            # the thread's only Python frame, as a C++ thread's callback
        try:
            answers.append(recorder.where(3))
        except BaseException as exc:  # noqa: B036  shown by the assertion below
            answers.append(exc)
        done.set()

    _thread.start_new_thread(shallow, ())
    assert done.wait(30)
    assert isinstance(answers[0], tuple), answers[0]
