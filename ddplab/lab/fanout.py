"""One ipyparallel call to many engines, seen as one result per rank.

``lab.run`` and ``%%ranks`` send the same function to every rank. Asking each
engine's own view (``client[e].apply_async``) pickles the function once per
rank and builds one AsyncResult, with its futures and callbacks, per rank:
on 4 ranks that was most of ddplab's overhead over a raw ipyparallel call.
A view of all the engines sends the same messages after pickling once, and
its AsyncResult already holds one future per engine, in target order. The
lab waits on each rank separately (to show a rank's output live, to see which
rank hangs), so ``RankResult`` gives one of those futures the few methods of
an AsyncResult that the lab uses.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class RankResult:
    """One engine's part of a many-engine AsyncResult: ``ready``, ``wait``, ``get``,
    ``wait_for_output``, ``_metadata``.

    ``_metadata`` is the list ``ddplab.lab.channel.published`` reads, as on an
    AsyncResult of one engine: the dict ipyparallel updates in place as the
    rank publishes data and as its reply arrives.
    """

    def __init__(self, future: Any) -> None:
        self._future = future
        self._metadata = [future.output.metadata]

    def ready(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever); whether the reply came."""
        return _done_within(self._future, timeout)

    def get(self, timeout: float | None = None) -> Any:
        """The rank's return value; a failure ipyparallel reports (engine lost, aborted) is raised."""
        try:
            value = self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"no reply from the engine within {timeout} s") from None
        if isinstance(value, BaseException):   # how ipyparallel stores a remote failure
            raise value
        return value

    def wait_for_output(self, timeout: float | None = None) -> bool:
        """Wait until the rank's output (data messages after its reply too) has all arrived."""
        return _done_within(self._future.output, timeout)


def _done_within(future: Any, timeout: float | None) -> bool:
    """Whether ``future`` finishes (with a result or an error) within ``timeout`` seconds."""
    try:
        future.exception(timeout)
    except FutureTimeout:
        return False
    return True


def apply_to_each(view: Any, fn: Any, *args: Any) -> list[RankResult]:
    """``fn(*args)`` on every engine of ``view``, pickled once; one result per engine, in order."""
    sent = view.apply_async(fn, *args)
    return [RankResult(child) for child in sent._children]
