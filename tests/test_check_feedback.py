"""The one kind of feedback every check gives (``ddplab.check.Feedback``), and its headlines.

The type alone: how it renders (headline, per-rank table, detail, hint; the pass line), that a
notebook shows it as one block without ddplab's stack, that it survives pickling. Then the rules
for what a failed check says first, each with a real lab (issue 53): the student's own exception
by name and line (not "raised ddplab, so it cannot be checked"), a refusal on 4 ranks shown once,
a deadlock hint that matches where the ranks wait, a float64 answer off by float32's rounding named
as such, values compared rather than shapes. Those tests assert on the message of any
``AssertionError``, so that they run, and fail, on the code before the type existed.
"""

from __future__ import annotations

import pickle
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from conftest import cell_error

import ddplab
from ddplab.check import _core
from ddplab.check._feedback import Feedback, Row, spell_against

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------ the type
def test_a_failure_renders_headline_table_detail_and_hint_in_that_order():
    feedback = Feedback("token is wrong on rank 1.",
                        rows=[Row(0, "[3.0] (float32)", "[3.0] (float32)"),
                              Row(1, "[0.0] (float32)", "the ring's sum", wrong=True),
                              Row("all", "2 messages", wrong=True, note="count only the sends")],
                        detail=["It raised while the check ran ring."], hint="send after receiving.")
    assert feedback.render().splitlines() == [
        "token is wrong on rank 1.",
        "  rank 0: expected [3.0] (float32)",
        "          got      [3.0] (float32)",
        "  rank 1: expected the ring's sum",
        "          got      [0.0] (float32)   <-- wrong",
        "  all: got 2 messages   <-- wrong",
        "      count only the sends",
        "It raised while the check ran ring.",
        "Hint: send after receiving."]
    assert isinstance(feedback, AssertionError)           # nbval, nbgrader and ddplab grade see a failure
    assert str(feedback) == feedback.render()             # what a grader that has only the message shows
    assert feedback._render_traceback_() == feedback.render().splitlines()


def test_the_pass_is_the_same_type_and_prints_todays_line(capsys):
    assert Feedback.correct("every rank holds 10").render() == "Correct: every rank holds 10"
    _core.passed("every rank holds 10")
    assert capsys.readouterr().out == "Correct: every rank holds 10\n"


def test_a_headline_is_one_line():
    assert Feedback("a\n  b").headline == "a b"


def test_feedback_survives_pickling_and_travels_as_data():
    feedback = Feedback("x is wrong.", rows=[Row(0, "1", "2", True)], detail=["d"], hint="h")
    for copy in (pickle.loads(pickle.dumps(feedback)), Feedback.from_dict(feedback.as_dict())):
        assert copy.render() == feedback.render() and isinstance(copy, AssertionError)


def _deep_checker():
    """A checker that fails three frames down, as the real ones do."""
    def compare_it():
        _core.compare("total", [torch.tensor([3.0])], [torch.tensor([2.0])], hint="sum it.")
    compare_it()


def test_a_notebook_shows_one_block_without_ddplabs_stack(shell, capsys):
    shell.user_ns["_deep_checker"] = _deep_checker
    capsys.readouterr()
    error = cell_error(shell, "_deep_checker()")
    shown = capsys.readouterr().out
    assert isinstance(error, Feedback)
    assert shown.strip().splitlines() == str(error).splitlines(), shown
    assert "Traceback" not in shown and "_core.py" not in shown and "File " not in shown


def test_compare_names_a_float64_answer_computed_in_float32():
    expected = torch.linspace(-3, 3, 40, dtype=torch.float64).sin()
    in_float32 = expected.float().exp().log().double()         # one float32 step somewhere
    with pytest.raises(Feedback) as info:
        _core.compare("out", [expected], [in_float32], atol=1e-10, hint="merge the blocks.")
    message = str(info.value)
    assert "your code computes in float32 somewhere" in message.splitlines()[0], message
    assert "merge the blocks" not in message                  # the method is not blamed
    with pytest.raises(Feedback) as info:                       # a real mistake is not precision
        _core.compare("out", [expected], [expected + 0.1], atol=1e-10, hint="merge the blocks.")
    assert "float32" not in str(info.value) and "Hint: merge the blocks." in str(info.value)


def test_words_stand_in_for_an_expected_value_that_is_the_answer():
    with pytest.raises(Feedback) as info:
        _core.compare("mean_score", [torch.tensor([2.1666])] * 2, [torch.tensor([2.0])] * 2,
                      atol=1e-3, show_expected="the mean of all 6 scores")
    message = str(info.value)
    assert "2.16" not in message and "expected the mean of all 6 scores" in message
    assert "got      [2.0] (float32)   <-- wrong" in message


def test_large_tensors_are_compared_by_their_values_not_their_shapes():
    expected = torch.arange(480, dtype=torch.float64).reshape(8, 12, 5)
    got = expected.clone()
    got[0, 3, 1] += 0.5
    said = spell_against(expected, got)
    assert said == "1 of 480 elements differ, by up to 0.5; the first at [0, 3, 1]: 16.5 where 16 (float64)"
    assert spell_against(expected, expected.clone()) == "the same values (float64)"


# ------------------------------------------------------------------ the headlines, on real labs
slow = pytest.mark.slow


def swap_with_rank(t):
    other = 1 - rank  # noqa: F821,F841 - the commonest beginner bug: `rank` inside a function
    return t


@slow
def test_the_students_own_exception_comes_first_by_name_and_line(fresh_lab):
    with pytest.raises(AssertionError) as info:
        ddplab.check.swap_tensors(swap_with_rank)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("NameError: name 'rank' is not defined"), message
    assert "in swap_with_rank" in first and "so it cannot be checked" not in message
    assert "other = 1 - rank" in message                         # the student's line, with its source
    assert "dist.get_rank()" in message                          # the hint for it
    assert "ddplab/check" not in message and "Traceback (most recent" not in message   # their frames only


def gather_with_the_collective(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)


@slow
def test_a_refusal_on_four_ranks_is_shown_once_naming_the_ranks(fresh_lab4):
    with pytest.raises(AssertionError) as info:
        ddplab.check.all_gather_p2p(gather_with_the_collective)
    message = str(info.value)
    assert message.count("may not call dist.all_gather") == 1, message
    assert "on ranks 0, 1, 2, 3" in message.splitlines()[0], message
    assert len(message.splitlines()) <= 4, message               # about 70 lines before


def ping_pong_both_receive_first(x):
    other = torch.empty_like(x)
    dist.recv(other, src=1 - dist.get_rank())
    dist.send(x, dst=1 - dist.get_rank())
    return other


@slow
def test_a_deadlock_hint_matches_where_the_ranks_wait(fresh_lab):
    try:
        with pytest.raises(AssertionError) as info:
            ddplab.check.ping_pong(ping_pong_both_receive_first, timeout=3)
    finally:
        fresh_lab.restart()
    message = str(info.value)
    assert "rank 0: still in recv" in message and "rank 1: still in recv" in message, message
    assert "every rank is waiting in recv" in message
    assert "blocking sends facing each other" not in message      # what it said while both ranks received
