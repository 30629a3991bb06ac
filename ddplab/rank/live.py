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
import logging
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
log = logging.getLogger(__name__)


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
    """ipyparallel's ``publish_data`` on a ddplab rank, else None (plain Python, tests).

    The one data channel to the kernel: live output here and ``ddplab.progress``
    both publish through it. Any engine the kernel made a rank qualifies, however
    it was started (locally, ssh, Slurm).
    """
    engine = sys.modules.get("ddplab.rank.engine")      # a plain script never imports it
    if engine is None or not engine.in_lab() or "ipyparallel" not in sys.modules:
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

    def start(self) -> "Pump":
        _service.attach(self)
        return self

    def stop(self) -> None:
        """Stop publishing; once this returns, nothing more is sent for this cell."""
        _service.detach(self)
        self._watch.forget()

    def tick(self) -> None:
        """One look: the status, then the screen, each sent only if it changed."""
        self.publish_status()
        self.publish()

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

    def blocked_for(self) -> float | None:
        """Seconds this cell has sat in one torch.distributed call (None: in none)."""
        return self._watch.held_for()

    def publish_status(self) -> None:
        """Send the rank's status when it changed (blocked in a call, or no longer)."""
        status = self._watch.look()
        if status != self._status:
            self._status = status
            self._publish({STATUS_KEY: status})


def blocked_for() -> float | None:
    """Seconds the running cell's thread has sat in one torch.distributed call (None: in none,
    or no cell runs), as its live status measures it; asked from another thread."""
    pump = _service.pump
    return pump.blocked_for() if pump is not None else None


class _Service:
    """The one thread per engine that publishes for whichever ``Pump`` is running.

    A thread per cell cost a thread start and a join on every ``lab.run``,
    most of ddplab's overhead over a raw ipyparallel call, for cells that
    mostly print nothing. This thread is started on first use, sleeps while
    no cell runs, and publishes under a lock that ``detach`` takes, so no
    screen of a finished cell can arrive after its result.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pump: Pump | None = None
        self._thread: threading.Thread | None = None
        self._idle = False                    # the thread waits for a pump, with no timeout

    def attach(self, pump: Pump) -> None:
        with self._lock:
            self._pump = pump
            # is_alive: after a fork (code on a rank forking) only the forking thread exists
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ddplab-live",
                                                daemon=True)
                self._thread.start()
            elif self._idle:
                # Wake it only from its untimed wait: one inside its INTERVAL wait
                # picks the new pump up when that ends, as it would have looked
                # no sooner anyway. A wake per call (a thread switch, the GIL
                # handed over) was a measurable part of a short lab.run.
                self._lock.notify()

    @property
    def pump(self) -> Pump | None:
        """The pump of the cell running now, if any."""
        return self._pump

    def detach(self, pump: Pump) -> None:
        with self._lock:
            if self._pump is pump:
                self._pump = None

    def _run(self) -> None:
        with self._lock:
            while True:
                while self._pump is None:
                    self._idle = True
                    self._lock.wait()
                self._idle = False
                pump = self._pump
                self._lock.wait(INTERVAL)         # then look: the first look comes INTERVAL in
                if self._pump is not pump:
                    continue
                try:
                    pump.tick()
                except Exception:                 # a live view must never break the cell
                    log.debug("live view stopped for this cell", exc_info=True)
                    self._pump = None


_service = _Service()
