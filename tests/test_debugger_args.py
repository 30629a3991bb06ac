"""A debugger call that names a rank the lab does not have says so, on the kernel side and on a rank."""

import pytest

import ddplab
from ddplab.errors import ConfigError, RankError


def test_lab_debug_of_a_rank_the_lab_does_not_have_names_the_ranks(fresh_lab):
    with pytest.raises(ConfigError, match=r"lab.debug\(rank=7\)") as raised:
        fresh_lab.debug(rank=7)
    assert "0..1" in str(raised.value)


def test_a_breakpoint_on_a_rank_that_does_not_exist_fails_the_cell_instead_of_being_skipped(fresh_lab):
    with pytest.raises(RankError) as raised:
        fresh_lab.run_cell("import ddplab\nddplab.breakpoint(rank=5)\n", timeout=20)
    message = str(raised.value)
    assert "ddplab.breakpoint(rank=5): no rank has that number here" in message
    assert "one of 0..1" in message
    assert fresh_lab.healthy                          # nothing stopped: the cell simply failed


def test_a_breakpoint_outside_a_group_checks_only_the_type(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="a rank number"):
        ddplab.breakpoint(rank="0")
