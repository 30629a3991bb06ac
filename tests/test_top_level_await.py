"""Top-level ``await`` in a %%ranks cell runs, as in a notebook cell (issue 42; was SyntaxError
"'await' outside function")."""

from __future__ import annotations

import pytest

from ddplab.errors import RankError


def test_a_cell_that_awaits_at_top_level_runs_and_shows_its_last_value(fresh_lab, capsys):
    fresh_lab.run_cell("import asyncio\n"
                       "await asyncio.sleep(0.01)\n"
                       "total = torch.ones(1) * (rank + 1)\n"
                       "work = dist.all_reduce(total, async_op=True)\n"
                       "await asyncio.to_thread(work.wait)\n"
                       "print('sum', total.item())\n"
                       "async def plus_ten():\n"
                       "    return rank + 10\n"
                       "await plus_ten()\n", timeout=30)
    out = capsys.readouterr().out
    assert out.count("sum 3.0") == 2, out
    assert "10" in out.split("[rank 1]")[0] and "11" in out.split("[rank 1]")[1], out
    # The engine's own loop is back afterwards: a plain cell, and the next await, run as before.
    assert fresh_lab.run_cell("await asyncio.sleep(0)\nasyncio._get_running_loop() is not None\n",
                              timeout=30) is None
    assert capsys.readouterr().out.count("True") == 2


def test_an_error_after_an_await_shows_the_cells_line_only(fresh_lab):
    with pytest.raises(RankError) as info:
        fresh_lab.run_cell("import asyncio\nawait asyncio.sleep(0)\n1 / 0\n", timeout=30)
    message = str(info.value)
    assert 'File "<rank cell' in message and "line 3" in message and "ZeroDivisionError" in message
    assert "awaiting.py" not in message and "asyncio" not in message.split("Traceback")[1], message


def test_a_cell_asleep_at_an_await_is_named_at_its_line_not_in_select(shell, fresh_lab, capsys):
    from conftest import cell_error

    assert cell_error(shell, "%%rank 0 --grace 1\nimport asyncio\nawait asyncio.sleep(600)\n") \
        is None
    out = capsys.readouterr().out
    assert out.startswith("ddplab: rank 0 is still running this cell, in asyncio.tasks.sleep "
                          "(cell line 2), not inside a torch.distributed call"), out
    assert "select" not in out
    fresh_lab.restart()
