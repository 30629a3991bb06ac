"""A rank's recent output, sent to the kernel while a cell still runs.

The recorder in ``engine.py`` keeps a cell's whole output for the final,
rank-ordered replay. While the cell runs, a ``Pump`` thread on the rank also
takes what was written since its last look and, at most every ``INTERVAL``
seconds and only when it changed, publishes the rank's *screen*: the last
``SCREEN_CHARS`` characters, rendered as a terminal would (``\\r`` rewrites its
line, so tqdm shows one bar, not a wall of bars).

Why the data channel (``publish_data``, as ``ddplab.progress`` uses) and not
ipyparallel's own stdout stream: every message carries a whole screen, so the
kernel only ever needs the latest one (a missed message loses nothing), a
flood costs one small message per interval however much is printed, and the
rank's writes stay a list append (no lock, no per-write message). The same
screen is what the kernel shows of a rank that hangs: it keeps arriving while
the rank's main thread is blocked inside a C++ collective.

Beside the screen the pump publishes the rank's *status* under ``STATUS_KEY``:
``"blocked in recv, cell line 3"`` once the cell has sat in one
torch.distributed call for ``blocked.BLOCKED_AFTER`` seconds, ``""`` again
when the call returns (see ``ddplab.rank.blocked``: a look at the main
thread's stack from this thread, nothing wrapped). Only changes are sent.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Callable

from . import blocked

#: The key under which the screen is published, in each AsyncResult's ``.data``.
KEY = "ddplab_live"
#: The key of the rank's status: "" while running, "blocked in send, cell line 1" while blocked.
STATUS_KEY = "ddplab_live_status"
INTERVAL = 0.2
SCREEN_CHARS = 8000


def render(raw: str) -> str:
    """``raw`` text as a terminal shows it: each line's last ``\\r`` segment wins."""
    if "\r" not in raw:
        return raw
    lines = raw.split("\n")
    out = []
    for line in lines:
        parts = line.split("\r")
        out.append(next((p for p in reversed(parts) if p), ""))
    return "\n".join(out)


def publisher() -> Callable[[dict], None] | None:
    """ipyparallel's ``publish_data`` on a ddplab rank, else None (plain Python, tests)."""
    if "DDPLAB_PARENT_PID" not in os.environ or "ipyparallel" not in sys.modules:
        return None
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
    except ImportError:
        return None
    if not ZMQInteractiveShell.initialized():
        return None
    data_pub = getattr(ZMQInteractiveShell.instance(), "data_pub", None)
    return data_pub.publish_data if data_pub is not None else None


class Pump:
    """Publishes the screen and status of one running cell. ``chunks`` is fed by the recorder.

    Made in the thread that runs the cell: that is the thread whose stack it watches.
    """

    def __init__(self, publish: Callable[[dict], None]) -> None:
        self.chunks: collections.deque = collections.deque()
        self._publish = publish
        self._raw = ""
        self._sent = ""
        self._watch = blocked.Watch(threading.get_ident())
        self._status = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddplab-live", daemon=True)

    def start(self) -> "Pump":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * INTERVAL + 1)
        self._watch.forget()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL):
            try:
                self.publish_status()
                self.publish()
            except Exception:          # a live view must never break the cell
                return

    def take(self) -> str:
        """What was written since the last call, at most its last SCREEN_CHARS characters."""
        chunks = self.chunks
        if len(chunks) > 1000:
            # A flood: keep only the newest; writes that slip in between
            # these two lines miss the live view (never the final output).
            taken = list(chunks)
            chunks.clear()
        else:
            taken = []
            while chunks:
                taken.append(chunks.popleft())
        tail, size = [], 0
        for chunk in reversed(taken):
            tail.append(chunk)
            size += len(chunk)
            if size >= SCREEN_CHARS:
                break
        return "".join(reversed(tail))

    def publish(self) -> None:
        new = self.take()
        if not new:
            return
        self._raw = (self._raw + new)[-SCREEN_CHARS:]
        screen = render(self._raw)
        if screen != self._sent:
            self._sent = screen
            self._publish({KEY: screen})

    def publish_status(self) -> None:
        """Send the rank's status when it changed (blocked in a call, or no longer)."""
        status = self._watch.look()
        if status != self._status:
            self._status = status
            self._publish({STATUS_KEY: status})
