"""The watchers a lab chooses for each call's wait (``ddplab.lab.watchers``), on real engines.

Each test swaps the session lab's watchers for the ones it needs and puts them back: what a
wait does besides waiting is exactly what its watchers do, in the protocol's order; a verdict
ends a call as a hang at once; a watcher that moves the deadline keeps the call waiting; a lab
attached to another's ranks runs none; and a quick call asks the ranks nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import pytest

import ddplab
from ddplab.errors import HangError
from ddplab.lab import attached, stall
from ddplab.lab.lab import IN_NOTEBOOK
from ddplab.lab.watchers import Call, Verdict


@contextlib.contextmanager
def watched_by(lab, *kinds) -> Iterator[None]:
    chosen = lab.calls.watchers
    lab.calls.watchers = kinds
    try:
        yield
    finally:
        lab.calls.watchers = chosen


def sleep_then(seconds: float, value: int) -> int:
    import time
    time.sleep(seconds)
    return value


def report_progress() -> int:
    from ddplab import progress
    progress.report(1, 1, loss=0.5)
    return 1


class Journal:
    """A watcher that writes down what it is told, in order."""
    seen: list[tuple[str, object]] = []

    def start(self, call: Call) -> None:
        Journal.seen.append(("start", (call.kind, call.running())))

    def tick(self, call: Call, now: float) -> Verdict | None:
        Journal.seen.append(("tick", call.running()))
        return None

    def expired(self, call: Call, now: float) -> Verdict | None:
        Journal.seen.append(("expired", call.running()))
        return None

    def stop(self, call: Call) -> None:
        Journal.seen.append(("stop", call.running()))


def test_a_wait_runs_its_watchers_in_the_protocols_order(fresh_lab):
    Journal.seen = []
    with watched_by(fresh_lab, Journal):
        assert fresh_lab.run(sleep_then, 0.5, 7) == [7, 7]
    kinds = [what for what, _ in Journal.seen]
    assert Journal.seen[0] == ("start", ("cell", [0, 1]))
    assert kinds.count("start") == 1 and kinds.count("stop") == 1 and kinds[-1] == "stop"
    assert kinds.count("tick") >= 2                 # a 0.5 s call: a tick at least every 0.2 s
    assert "expired" not in kinds                   # it finished within its timeout
    assert Journal.seen[-1] == ("stop", [])         # every rank came back


class Impatient:
    """A watcher that calls every wait hung at its first tick with ranks running."""

    def start(self, call: Call) -> None: ...

    def tick(self, call: Call, now: float) -> Verdict | None:
        return Verdict("abandoned", "ddplab: an impatient watcher says so.")

    def expired(self, call: Call, now: float) -> Verdict | None:
        return None

    def stop(self, call: Call) -> None: ...


def test_a_verdict_from_a_tick_ends_the_call_as_a_hang_with_its_headline(fresh_lab):
    began = time.monotonic()
    with watched_by(fresh_lab, Impatient), pytest.raises(HangError) as raised:
        fresh_lab.run(sleep_then, 30, 1, timeout=60)
    assert time.monotonic() - began < 30            # ended at once, not after the sleep
    assert str(raised.value).startswith("ddplab: an impatient watcher says so.\n")
    assert raised.value.states == {0: "still running", 1: "still running"}
    assert sorted(raised.value.where) == [0, 1]     # the report still says where each is
    assert not fresh_lab.healthy                    # the ranks still sleep: a restart is needed


class Patient:
    """A watcher that waits on once, for one more second, at the first expiry."""
    waited = 0

    def start(self, call: Call) -> None: ...

    def tick(self, call: Call, now: float) -> Verdict | None:
        return None

    def expired(self, call: Call, now: float) -> Verdict | None:
        if Patient.waited == 0:
            Patient.waited += 1
            call.deadline = time.monotonic() + 2.0
        return None

    def stop(self, call: Call) -> None: ...


def test_a_watcher_that_moves_the_deadline_keeps_the_call_waiting(fresh_lab):
    Patient.waited = 0
    with watched_by(fresh_lab, Patient):
        assert fresh_lab.run(sleep_then, 1.5, 3, timeout=1) == [3, 3]   # past its timeout
    assert Patient.waited == 1
    with watched_by(fresh_lab), pytest.raises(HangError, match="did not finish within timeout=1 s"):
        fresh_lab.run(sleep_then, 1.5, 3, timeout=1)                     # none: the timeout stands


def test_a_quick_call_asks_the_ranks_nothing(fresh_lab, monkeypatch):
    """The stall watch asks the ranks (a question to a thread of each) only once a wait has run
    ``ABANDON_LOOK_S``: it asked at once before, and every ``lab.run`` paid for it (14 ms a
    call under load, half of the round trip)."""
    asked: list[str] = []
    for name in ("collectives", "frames", "cpu_seconds"):
        real = getattr(fresh_lab.engines, name)
        monkeypatch.setattr(fresh_lab.engines, name,
                            lambda *a, _real=real, _name=name, **k: asked.append(_name) or _real(*a, **k))
    quick = 0
    for _ in range(10):
        asked.clear()
        began = time.monotonic()
        fresh_lab.run(sleep_then, 0, 1)
        if time.monotonic() - began < stall.ABANDON_LOOK_S:
            quick += 1
            assert asked == [], asked
    assert quick, "no call of ten was quicker than ABANDON_LOOK_S: the machine is too loaded to say"
    asked.clear()
    fresh_lab.run(sleep_then, 3 * stall.ABANDON_LOOK_S, 1)
    assert "collectives" in asked                   # a longer wait still asks (abandoned ranks)


def test_a_notebook_lab_runs_the_front_and_the_stall_watch_and_an_attached_one_none(
        fresh_lab, monkeypatch):
    # Which watchers a call's wait started, seen from their own start(): what the bars look like
    # is tests/test_progress.py's (here they hung on the suite's history, not on the watchers).
    started = []
    for kind in IN_NOTEBOOK:
        def spy(self, call, _start=kind.start):
            started.append(type(self).__name__)
            return _start(self, call)
        monkeypatch.setattr(kind, "start", spy)
    assert fresh_lab.calls.watchers == IN_NOTEBOOK
    assert fresh_lab.run(report_progress) == [1, 1]
    assert started == [kind.__name__ for kind in IN_NOTEBOOK], started
    started.clear()
    mine = attached.lab_at(fresh_lab.directory, 60)
    try:
        assert mine.calls.watchers == ()
        assert mine.run(report_progress) == [1, 1]
        assert started == [], started                 # nobody draws bars or watches for stalls
    finally:
        mine.stop()
    assert fresh_lab.healthy and ddplab.current() is not mine
