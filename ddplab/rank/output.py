"""How a rank's output is recorded: in order, capped, and shown under its label.

``print`` and warnings (``sys.stdout``/``sys.stderr``), ``display()``, and
what bypasses Python (fd 1 and 2, through ``fdcapture``) all end in one
``OutputRecorder`` per cell, in the order the rank produced them. ``engine.run_cell``
and ``engine.call`` wrap their work in ``capture(recorder)``; the kernel
replays the recorder's ``events`` under ``[rank N]``, in rank order.

Between cells a rank's output goes to an idle recorder and opens its next
cell under ``BETWEEN_CELLS_NOTE``: kept, not dropped, because a late gloo
warning or a background thread's message is often the clue to what went
wrong; it is capped at ``KEEP_IDLE`` characters.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import threading
from typing import Callable, Iterator

from . import fdcapture, live


def _shell():
    from IPython import get_ipython
    return get_ipython()


#: How much of a cell's text one rank keeps: the first ``KEEP_HEAD`` and the
#: last ``KEEP_TAIL`` characters. What lies between is dropped and replaced
#: by one "output truncated" line, so a print loop never slows the rank down
#: nor floods the notebook (a notebook output of megabytes is unreadable anyway).
KEEP_HEAD = 512 * 1024
KEEP_TAIL = 512 * 1024


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def settled(data: dict) -> dict | None:
    """A display as it stands when the cell ends: a widget's final state, as text.

    A widget shown on a rank (``tqdm.auto`` picks ``tqdm.notebook``'s bar there)
    lives on the rank: the notebook cannot draw it, and the text it was
    displayed with is its first state ("0/20"). So it is shown as its current
    text instead (tqdm's bar as it ended); a widget closed since (tqdm's
    ``leave=False``) is shown as nothing, as in a notebook.
    """
    view = data.get(WIDGET_VIEW)
    if not isinstance(view, dict):
        return data
    module = sys.modules.get("ipywidgets.widgets.widget")
    instances = getattr(module, "_instances", None) or {}
    widget = instances.get(view.get("model_id"))
    if widget is None:
        return None
    from IPython.lib.pretty import pretty
    return {"text/plain": pretty(widget)}


class OutputRecorder:
    """Collects a cell's output as an ordered list of events, in time linear in its size.

    Events are ``("stdout", text)``, ``("stderr", text)`` and
    ``("display", data, metadata)``; adjacent text of one stream is merged.
    Text is kept as a list of chunks and joined once, in ``events``: joining
    at every write would copy everything printed so far each time.
    Past ``KEEP_HEAD`` characters, new output goes to a tail that keeps only
    the last ``KEEP_TAIL`` characters; ``events`` then holds the head, a note
    saying how much was dropped, and the tail.
    """

    def __init__(self, head: int = KEEP_HEAD, tail: int = KEEP_TAIL) -> None:
        self._head: list[list] = []          # [stream, [chunks]] or ["display", data, metadata]
        self._tail: collections.deque = collections.deque()   # same items, oldest first
        self._head_max, self._tail_max = head, tail
        self._head_left, self._tail_size = head, 0
        self.dropped_chars = self.dropped_lines = 0
        self.live: collections.deque | None = None    # a live.Pump's chunks, while one runs

    def text(self, stream: str, data: str) -> None:
        size = len(data)
        if not size:
            return
        if self.live is not None:
            self.live.append(data)
        if size <= self._head_left:
            self._head_left -= size
            items = self._head
        elif self._head_left > 0:               # the head fills up inside this write
            cut, self._head_left = self._head_left, 0
            self._append(self._head, stream, data[:cut])
            self.text(stream, data[cut:])
            return
        else:
            self._tail_size += size
            tail = self._tail
            if tail and tail[-1][0] == stream:      # inlined: this is the hot path of a flood
                tail[-1][1].append(data)
            else:
                tail.append([stream, collections.deque([data])])
            # Trim in batches (amortized O(1)), after appending: one write larger
            # than the tail (fd-level output comes in chunks of a megabyte) is cut too.
            if self._tail_size > 2 * self._tail_max:
                self._trim()
            return
        if items and items[-1][0] == stream:
            items[-1][1].append(data)
        else:
            items.append([stream, collections.deque([data])])

    @staticmethod
    def _append(items, stream: str, data: str) -> None:
        if items and items[-1][0] == stream:
            items[-1][1].append(data)
        else:
            items.append([stream, collections.deque([data])])

    def _trim(self) -> None:
        """Drop the oldest tail text until the tail holds at most its limit."""
        while self._tail_size > self._tail_max:
            item = self._tail[0]
            if item[0] == "display":          # a display in the dropped stretch goes too
                self._tail.popleft()
                continue
            text, excess = "".join(item[1]), self._tail_size - self._tail_max
            if len(text) <= excess:
                self._tail.popleft()
                cut = text
            else:
                cut, item[1] = text[:excess], collections.deque([text[excess:]])
            self.dropped_chars += len(cut)
            self.dropped_lines += cut.count("\n")
            self._tail_size -= len(cut)

    def absorb(self, other: "OutputRecorder") -> None:
        """Append everything ``other`` recorded (its kept text, and what it dropped)."""
        if not other._head and not other._tail:
            return
        screen, self.live = self.live, None      # the live view had this text already
        try:
            for item in [*other._head, *other._tail]:
                if item[0] == "display":
                    self.display(item[1], item[2])
                else:
                    self.text(item[0], "".join(item[1]))
        finally:
            self.live = screen
        self.dropped_chars += other.dropped_chars
        self.dropped_lines += other.dropped_lines

    def display(self, data: dict, metadata: dict | None) -> None:
        target = self._head if self._head_left > 0 else self._tail
        target.append(["display", data, metadata or {}])

    @property
    def truncated(self) -> bool:
        return self.dropped_chars > 0

    @property
    def events(self) -> list[tuple]:
        self._trim()
        items, tail = list(self._head), [list(i) for i in self._tail]
        if self.truncated:
            note = self.truncation_note()
            last = next((i for i in reversed(items) if i[0] != "display"), None)
            if last is None or last[1][-1].endswith("\n"):
                note = note[1:]
            items.append(["stdout", [note]])
            first = next((i for i in tail if i[0] != "display"), None)
            if first is not None:                 # start the tail at a line's start
                text = "".join(first[1])
                first[1] = [text[text.find("\n") + 1:]] if "\n" in text[:-1] else [text]
        items += tail
        events: list[tuple] = []
        for item in items:
            if item[0] == "display":
                data = settled(item[1])
                if data is not None:
                    events.append(("display", data, item[2]))
                continue
            text = "".join(item[1])
            if not text:
                continue
            if events and events[-1][0] == item[0]:
                events[-1] = (item[0], events[-1][1] + text)
            else:
                events.append((item[0], text))
        return events

    def truncation_note(self) -> str:
        return (f"\n[ddplab: output truncated: about {self.dropped_lines:,} lines "
                f"({self.dropped_chars:,} characters) dropped here; kept the first "
                f"{self._head_max:,} and the last {self._tail_max:,} characters]\n")


#: Between cells a rank keeps at most this much of what it writes (a background
#: thread, a late gloo warning), and shows it at the start of its next cell.
KEEP_IDLE = 64 * 1024
BETWEEN_CELLS_NOTE = "[ddplab: this rank wrote this between cells, after its previous cell had ended]\n"


class _Output:
    """Where this rank's output goes now: a cell's recorder, or between cells the idle one.

    ``print`` (``_Stream.write``) calls the current recorder's ``text`` with no
    lock and no check: that path costs what it did before fd capture. The fd
    reader thread (``fdcapture``) never touches that recorder; it fills
    ``inbox`` (a capped recorder of its own, under ``inbox_lock``) and points
    the streams at ``_merge_then_write``. So the next ``print`` (or
    ``display``, or the cell's end) first moves the inbox into the recorder
    (``merge``): fd-level text lands where the rank was when it arrived,
    memory stays capped however much a subprocess writes while the rank
    waits, and the live view still gets the text at once.
    """

    def __init__(self) -> None:
        self.inbox_lock = threading.Lock()
        self.inbox = OutputRecorder()
        self.dirty = False                  # the inbox holds text not merged yet
        self.hiding = 0                     # inside hide_fd_output(): fd-level text is dropped
        self.idle = OutputRecorder(KEEP_IDLE, KEEP_IDLE)
        self.sink = self.idle
        self.fds: fdcapture.FdCapture | None = None   # set once this engine is a rank
        self.originals: tuple = (sys.stdout, sys.stderr)

    def deliver(self, stream: str, text: str) -> None:
        """fdcapture's sink (reader thread, or a drain): text that arrived on fd 1 or 2."""
        if self.hiding:
            return
        with self.inbox_lock:
            self.inbox.text(stream, text)
            if not self.dirty:
                self.dirty = True
                _STDOUT.emit = _STDERR.emit = self._merge_then_write
        screen = self.sink.live
        if screen is not None:              # a deque: appending from this thread is safe
            screen.append(text)

    def merge(self) -> None:
        """Move what fd 1 and 2 brought so far into the current recorder, in order."""
        with self.inbox_lock:
            inbox, self.inbox, self.dirty = self.inbox, OutputRecorder(), False
            _STDOUT.emit = _STDERR.emit = self.sink.text
        self.sink.absorb(inbox)

    def _merge_then_write(self, stream: str, data: str) -> None:
        self.merge()
        self.sink.text(stream, data)

    def capture_fds(self) -> None:
        """Capture fd 1 and 2 from now on (once per process): subprocesses, os.write, C++ logs."""
        if self.fds is None:
            self.fds = fdcapture.FdCapture(self.deliver).start()
            os.register_at_fork(after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        # A forked child (a DataLoader worker) prints straight to fd 1 and 2,
        # which still are our pipes: its output reaches this rank's recorder.
        self.inbox_lock = threading.Lock()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__

    def _point_at(self, recorder: OutputRecorder) -> None:
        with self.inbox_lock:
            self.sink = recorder
            _STDOUT.emit = _STDERR.emit = self._merge_then_write if self.dirty else recorder.text

    def begin(self, recorder: OutputRecorder) -> None:
        """Send output to ``recorder``; what came between cells goes first, under a note."""
        if self.fds is not None:
            self.fds.drain()            # what is in the pipes now came before this cell
        self.merge()
        idle = self.idle
        self.idle = OutputRecorder(KEEP_IDLE, KEEP_IDLE)
        self._point_at(recorder)
        events = idle.events
        if events:
            recorder.text("stdout", BETWEEN_CELLS_NOTE)
            for event in events:
                if event[0] == "display":
                    recorder.display(event[1], event[2])
                else:
                    recorder.text(event[0], event[1])

    def end(self) -> None:
        """The cell is over: collect what it wrote to fd 1 and 2, then record between cells."""
        if self.fds is not None:
            self.fds.drain()
        self.merge()
        self._point_at(self.idle)


class _Stream:
    """``sys.stdout`` or ``sys.stderr`` of a rank: writes go to the current recorder.

    No ``__getattr__`` passing other names on to ipykernel's stream: ``print``
    looks up a name that is missing, and the fallback made every print slower.
    """

    encoding = "utf-8"

    def __init__(self, name: str) -> None:
        self.name = name
        self.fd = 1 if name == "stdout" else 2
        #: ``recorder.text`` of the current recorder; ``_Output`` points it
        #: elsewhere while fd 1 or 2 has brought text that must go first.
        self.emit: Callable[[str, str], None] = lambda stream, data: None

    def write(self, data: str) -> int:
        self.emit(self.name, data)
        return len(data)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        """fd 1 or 2 once they are captured (faulthandler, subprocess(stdout=sys.stdout))."""
        if _output.fds is None:
            raise io.UnsupportedOperation("fileno")
        return self.fd


_STDOUT, _STDERR = _Stream("stdout"), _Stream("stderr")
_output = _Output()
_output.end()                                   # between cells until the first one


@contextlib.contextmanager
def hide_fd_output() -> Iterator[None]:
    """On a rank: drop what fd 1 and 2 receive inside the block; ``print`` still shows.

    For ddplab's own checkers, which provoke C++ log lines on purpose (a store
    wait that must time out logs an error with a timestamp): a passing check
    shows its one fixed line, not that noise. And for a notebook demo that
    fails on purpose (09's ``monitored_barrier``, whose error torch also logs),
    so its stored output stays the same from run to run. Student code never
    needs it.
    """
    fds = _output.fds
    if fds is None:
        yield
        return
    fds.drain()
    _output.hiding += 1
    try:
        yield
    finally:
        fds.drain()
        _output.hiding -= 1


class capture:
    """Context manager: route print, fd 1 and 2, warnings and display() into an OutputRecorder."""

    def __init__(self, recorder: OutputRecorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> OutputRecorder:
        publish = live.publisher()
        self.pump = live.Pump(publish).start() if publish is not None else None
        if self.pump is not None:
            self.recorder.live = self.pump.chunks
        if not isinstance(sys.stdout, _Stream):
            _output.originals = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _STDOUT, _STDERR
        _output.begin(self.recorder)
        shell = _shell()
        if shell is not None:
            self.saved_publish = shell.display_pub.publish
            recorder = self.recorder

            def publish(data, metadata=None, *args, **kwargs) -> None:
                if _output.dirty:
                    _output.merge()
                recorder.display(data, metadata)
            shell.display_pub.publish = publish
        return self.recorder

    def __exit__(self, *exc) -> None:
        _output.end()
        if self.pump is not None:
            self.pump.stop()
            self.recorder.live = None
        if _output.fds is None:
            sys.stdout, sys.stderr = _output.originals
        # else: a rank keeps recording between cells (a background thread's print).
        shell = _shell()
        if shell is not None:
            shell.display_pub.publish = self.saved_publish


def capture_fds() -> None:
    """From now on capture this process's fd 1 and 2 (once a rank joined the lab)."""
    _output.capture_fds()
