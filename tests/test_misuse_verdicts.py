"""Misuses an adversarial pass found (issue 58, pass 6) answered with a raw AttributeError or a
wrong verdict: a named check given the student's function, ``ddplab.hint`` given a non-string,
and the grader calling a cell that never waited on another rank "a deadlock"."""

from __future__ import annotations

import pytest
from conftest import cell_error

import ddplab
from ddplab.errors import CourseError
from ddplab.grade.run import reason


def test_a_named_check_given_the_students_function_says_how_to_call_it(fresh_lab):
    def global_mean(losses):
        return losses.mean()

    with pytest.raises(ddplab.check.Feedback) as info:
        ddplab.check.global_mean(global_mean)       # was: AttributeError ... 'world_size'
    said = str(info.value)
    assert said.startswith("ddplab.check.global_mean() was given the function global_mean"), said
    assert "finds your answer by name on the ranks" in said and "Traceback" not in said
    with pytest.raises(ddplab.check.Feedback, match=r"ddplab.check.mean_score\(\) was given 42"):
        ddplab.check.mean_score(lab=42)             # was: AttributeError ... 'run'


@pytest.mark.parametrize("name", [None, 42, print])
def test_hint_and_solution_of_a_non_string_name_say_what_a_name_is(name):
    for ask in (ddplab.hint, ddplab.solution):
        with pytest.raises(CourseError, match=r"an exercise is named by a string"):
            ask(name)                               # was: AttributeError ... 'strip'


def test_the_graders_reason_for_a_cell_in_its_own_code_is_not_a_deadlock(fresh_lab, shell):
    error = cell_error(shell, "%%ranks --timeout 2\nwhile True: pass")
    assert isinstance(error, ddplab.HangError), error
    fresh_lab.restart()
    said = reason("HangError", str(error))
    assert "deadlock" not in said and said.startswith("HangError: no rank waited for another"), said
    with pytest.raises(ddplab.HangError) as info:
        fresh_lab.run(_recv_from_the_other, timeout=2)
    fresh_lab.restart()
    said = reason("HangError", str(info.value))
    assert said.startswith("HangError: a deadlock (ranks waited for each other"), said


def _recv_from_the_other():
    import torch
    import torch.distributed as dist
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def test_a_misspelt_keyword_to_start_names_the_keyword_and_starts_nothing():
    from ddplab.errors import ConfigError
    from ddplab.lab import current_lab

    before = current_lab.current_or_none()
    with pytest.raises(ConfigError) as info:
        ddplab.start(world_size=2, wrld=3)          # was: TypeError from _start_hosts()
    said = str(info.value)
    assert said.startswith("ddplab.start() got an unknown keyword wrld=: did you mean "
                           "world_size=?"), said
    assert "_start_hosts" not in said and "listen" in said
    assert current_lab.current_or_none() is before
