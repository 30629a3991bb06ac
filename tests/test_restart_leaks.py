"""Issue 19 item 10: restarts must not leak file descriptors or threads in the kernel."""

import os
import threading

import pytest
from conftest import side_lab


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_fifty_restarts_and_stops_leak_no_fd_or_thread():
    lab = side_lab(1, pg_timeout=60)
    try:
        lab.restart()                       # the first restart may open what later ones reuse
        lab.stop()
        lab.restart()
        fds, threads = _fds(), threading.active_count()
        for i in range(50):
            if i % 10 == 9:
                lab.stop()                  # stop frees what the lab held, too
            lab.restart()
        assert lab.run(lambda: 1) == [1]
        assert (_fds(), threading.active_count()) == (fds, threads), \
            f"fds {fds} -> {_fds()}, threads {threads} -> {threading.active_count()}"
    finally:
        lab.stop()
