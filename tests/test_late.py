"""Issue 19: what a careless student breaks, on real engines (items 3, 4, 5, 15)."""

import pytest
from conftest import cell_error

import ddplab
from ddplab.lab import magics

pytestmark = pytest.mark.slow


def test_late_error_of_an_earlier_cell_never_fails_the_next_call(shell, fresh_lab, capsys):
    cell = "%%rank 1 --grace 0.3\nimport time\ntime.sleep(1.5)\nraise ValueError('late boom')"
    assert cell_error(shell, cell) is None
    capsys.readouterr()
    # The next call's own result survives, and the lab stays usable.
    assert fresh_lab.run(_rank_times_ten) == [0, 10]
    out = capsys.readouterr().out
    assert "the earlier cell still running on rank 1 raised" in out
    assert "not this cell's" in out and "ValueError: late boom" in out
    assert not fresh_lab.broken_reason
    assert fresh_lab.run(lambda: 7) == [7, 7]
    assert "late boom" not in capsys.readouterr().out        # shown once


def test_late_error_never_fails_a_correct_check(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%rank 0 --grace 0.3\nimport time\ntime.sleep(1.5)\n1 / 0") is None
    # A correct all_reduce on every rank, after the late cell, passes.
    got = fresh_lab.run(_all_reduce_sum)
    assert got == [3.0, 3.0]
    assert "ZeroDivisionError" in capsys.readouterr().out
    assert not fresh_lab.broken_reason


def _rank_times_ten():
    import torch.distributed as dist
    return dist.get_rank() * 10


def _all_reduce_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def test_slow_cell_is_not_called_waiting_for_another_rank(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%rank 0 --grace 0.5\nimport time\ntime.sleep(3)") is None
    out = capsys.readouterr().out
    assert out.startswith("ddplab: rank 0 is still running this cell, at cell line 2, "
                          "not inside a torch.distributed call"), out
    assert "waiting for another rank (" not in out and "matching cell" not in out
    fresh_lab.wait()


def test_blocked_send_is_called_waiting_for_another_rank(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%rank 0 --grace 0.5\ndist.send(torch.ones(2), dst=1)") is None
    out = capsys.readouterr().out
    assert out.startswith("ddplab: rank 0 is still running this cell, in send (cell line 1): "
                          "waiting for another rank"), out
    assert cell_error(shell, "%%rank 1\nt = torch.zeros(2)\ndist.recv(t, src=0)") is None


def test_a_rank_still_running_is_named_once(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%rank 0 --grace 0.3\nimport time\ntime.sleep(2)") is None
    assert cell_error(shell, "%%rank 0 --grace 0.3\nprint('next')") is None
    out = capsys.readouterr().out
    assert "rank 0, 0" not in out and out.count("rank 0 is still running") == 2, out
    fresh_lab.wait()


def test_unclosed_quote_and_ranks_grace_are_clear_errors(shell, fresh_lab):
    error = cell_error(shell, "%%rank 0 'x\nprint(1)")
    assert isinstance(error, ddplab.ConfigError) and "Close the quote" in str(error)
    error = cell_error(shell, "%%ranks --grace 3\nprint(1)")
    assert isinstance(error, ddplab.ConfigError) and "does not take --grace" in str(error)
    with pytest.raises(ddplab.ConfigError):
        magics._parse("--grace 2", "ranks")


def test_kernel_function_using_rank_gets_a_hint(shell, fresh_lab):
    assert cell_error(shell, "def f():\n    return rank * 2\n") is None
    error = cell_error(shell, "ddplab.current().run(f)")
    assert isinstance(error, ddplab.RankError)
    assert "NameError: name 'rank' is not defined" in error.failures[0]
    assert "Use dist.get_rank() inside the function" in error.failures[0]


def test_restart_after_stop_is_the_current_lab(shell, tmp_path):
    lab = ddplab.start(world_size=1, backend="gloo", timeout=30)
    try:
        lab.stop()
        lab.restart()
        assert ddplab.current() is lab
        assert cell_error(shell, "%%ranks\nprint('here', rank)") is None
        assert ddplab.start(world_size=1, backend="gloo", timeout=30) is lab
    finally:
        lab.stop()
    assert not lab.directory
