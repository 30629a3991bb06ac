"""The checkers' shared core: fixed line on success, per-rank table on failure."""

from __future__ import annotations

import types

import pytest
import torch

import ddplab
from ddplab.check import _core


def test_compare_accepts_equal_values_and_prints_nothing(capsys):
    _core.compare("total", [torch.tensor([1.0]), 2], [torch.tensor([1.0]), 2])
    assert capsys.readouterr().out == ""


def test_compare_shows_expected_and_got_per_rank():
    with pytest.raises(AssertionError) as info:
        _core.compare("total", [torch.tensor([3.0]), torch.tensor([3.0])],
                      [torch.tensor([3.0]), torch.tensor([2.0])], hint="did rank 1 all_reduce?")
    message = str(info.value)
    assert message.splitlines()[0] == "total is wrong on rank 1."
    assert "rank 1: expected [3.0] (float32)" in message and "got      [2.0] (float32)   <-- wrong" in message
    assert "Hint: did rank 1 all_reduce?" in message


@pytest.mark.parametrize("expected, got", [
    (torch.tensor([1, 2]), torch.tensor([1, 2, 3])),        # shape
    (torch.tensor([1.5]), torch.tensor([1])),                # float answer given as an int
    (torch.tensor([1.0]), [1.0]),                            # not a tensor
    ([1, 2], [1, 2, 3]),
    (1.0, 1.1),
    ("a", 1),
])
def test_same_rejects(expected, got):
    assert not _core.same(expected, got)


def test_same_tolerance_only_when_asked():
    assert not _core.same(torch.tensor([1.0]), torch.tensor([1.0 + 1e-6]))
    assert _core.same(torch.tensor([1.0]), torch.tensor([1.0 + 1e-6]), atol=1e-5)


def test_values_on_ranks_names_missing_variable(fresh_lab):
    fresh_lab.run_cell("answer = rank * 2")
    assert _core.values_on_ranks("answer") == [0, 2]
    fresh_lab.run_cell("only_here = 1", ranks=[0])
    with pytest.raises(ddplab.check.Feedback,
                       match=r"^no variable `only_here` on rank 1\.\nHint: run the exercise cell .*%%ranks"):
        _core.values_on_ranks("only_here")


def test_passed_prints_one_fixed_line(capsys):
    _core.passed("every rank holds 10")
    assert capsys.readouterr().out == "Correct: every rank holds 10\n"


def test_compare_spells_lists_of_tensors_readably():
    with pytest.raises(AssertionError) as info:
        _core.compare("gathered", [[torch.tensor([0.0]), torch.tensor([1.0])]],
                      [[torch.tensor([0.0]), torch.tensor([0.0])]])
    assert "expected [[0.0] (float32), [1.0] (float32)]" in str(info.value)


#: What a notebook module may export besides its checkers: a notebook's helpers and course content.
NOT_CHECKERS = {"scores_of", "Mystery", "mystery"}


@pytest.mark.parametrize("notebook", ddplab.check.NOTEBOOKS)
def test_every_checker_is_public_under_its_own_name(notebook):
    """One test for every notebook's module (it was one copy per module): each name it exports is
    ``ddplab.check.<name>``, documented, and a ``@checker`` (its lab resolved once, by the decorator)."""
    import importlib

    module = importlib.import_module(f"ddplab.check.{notebook}")
    assert module.__all__, notebook
    for name in module.__all__:
        assert getattr(ddplab.check, name) is getattr(module, name), name
        assert getattr(module, name).__doc__, name
        if name not in NOT_CHECKERS:
            assert hasattr(getattr(module, name), "reads_trace"), f"{name} is not a @checker"


def test_the_timeline_checkers_say_they_read_the_trace():
    """The grader hands the last trace to these (``ddplab.grade.witness.asked``), and only these."""
    reads = sorted(name for name in ddplab.check.__all__
                   if getattr(getattr(ddplab.check, name), "reads_trace", False))
    assert reads == ["ddp_all_reduces", "messages_per_rank", "straggler", "who_waited"]



def test_checker_resolves_the_lab_once_and_names_the_fix_without_one(monkeypatch):
    from ddplab.errors import DdplabError
    from ddplab.lab import current_lab

    seen = []

    @_core.checker
    def needs(answer, lab=None):
        seen.append(lab)

    @_core.checker(needs_lab=False)
    def optional(answer, lab=None):
        seen.append(lab)

    monkeypatch.setattr(current_lab, "_current", None)
    with pytest.raises(DdplabError, match="no lab is running. Start one with"):
        needs(1)
    optional(1)
    given = types.SimpleNamespace(run_each=None)       # what a lab has (an object without: refused)
    needs(1, given)                       # positional or keyword, the lab given is the lab used
    needs(1, lab=given)
    assert seen == [None, given, given]
    assert needs.__wrapped__.__name__ == "needs" and needs.reads_trace is False
