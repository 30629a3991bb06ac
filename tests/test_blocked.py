"""ddplab.rank.blocked: whether a thread has sat in one torch.distributed call, read from another thread.

The "torch.distributed call" here is a function compiled under the filename of
``distributed_c10d.py`` and called from code under a rank cell's filename, so
the stack the watch reads is the one a real ``dist.recv`` in a cell gives,
without a process group. Time is passed in (``look(now=...)``), so nothing
sleeps; threads hand over with events.
"""

from __future__ import annotations

import threading

from ddplab.rank import blocked
from ddplab.rank.engine import CELL_FILENAME

_C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LIMIT = 30                          # seconds any handover may take before the test fails


def _fake_dist(call: str = "recv") -> dict:
    """``recv`` and ``recv_object_list`` (which waits in ``recv``) as if defined in torch,
    and a rank cell that calls ``call`` once per ``(entered, release)`` pair."""
    names: dict = {}
    exec(compile("def recv(entered, release):\n    entered.set()\n    release.wait()\n"
                 "def recv_object_list(entered, release):\n    recv(entered, release)\n",
                 _C10D, "exec"), names)
    exec(compile(f"def cell(calls):\n    for entered, release in calls:\n"
                 f"        {call}(entered, release)\n", CELL_FILENAME.format(n=7), "exec"), names)
    return names


def _run_in_thread(calls: list, call: str = "recv") -> tuple[threading.Thread, blocked.Watch]:
    thread = threading.Thread(target=_fake_dist(call)["cell"], args=(calls,), daemon=True)
    thread.start()
    return thread, blocked.Watch(thread.ident)


def _steps(n: int) -> list[tuple[threading.Event, threading.Event]]:
    return [(threading.Event(), threading.Event()) for _ in range(n)]


def test_one_long_call_reads_blocked_with_its_cell_line_then_not_once_it_returns():
    calls = _steps(1)
    thread, watch = _run_in_thread(calls)
    assert calls[0][0].wait(LIMIT)
    assert watch.look(now=100.0) == ""                      # first sight: not yet
    assert watch.look(now=100.0 + blocked.BLOCKED_AFTER / 2) == ""
    assert watch.look(now=100.0 + blocked.BLOCKED_AFTER) == "blocked in recv, cell line 3"
    calls[0][1].set()
    thread.join(LIMIT)
    assert watch.look(now=200.0) == ""


def test_a_call_that_waits_inside_another_reads_as_the_call_the_user_made():
    calls = _steps(1)
    thread, watch = _run_in_thread(calls, "recv_object_list")
    assert calls[0][0].wait(LIMIT)
    watch.look(now=0.0)
    assert watch.look(now=blocked.BLOCKED_AFTER) == "blocked in recv_object_list, cell line 3"
    calls[0][1].set()
    thread.join(LIMIT)


def test_a_new_call_at_every_look_is_never_blocked():
    """A tight loop of short calls: each look finds a different call, however late it is."""
    calls = _steps(3)
    thread, watch = _run_in_thread(calls)
    for i, (entered, release) in enumerate(calls):
        assert entered.wait(LIMIT)
        assert watch.look(now=100.0 * (i + 1)) == ""
        release.set()
    thread.join(LIMIT)


def test_a_thread_outside_torch_distributed_is_not_blocked():
    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(LIMIT,), daemon=True)
    thread.start()
    watch = blocked.Watch(thread.ident)
    assert watch.look(now=0.0) == watch.look(now=10.0) == ""
    done.set()
    thread.join(LIMIT)
