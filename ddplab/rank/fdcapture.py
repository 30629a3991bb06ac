"""What a rank writes to file descriptors 1 and 2, captured like its ``print`` output.

``print`` goes through ``sys.stdout``, which ``output.py`` points at a
recorder. Much of what a rank shows never passes through Python's
``sys.stdout``: a child process (``subprocess.run(['echo', 'hi'])``),
``os.write(1, ...)``, C and C++ code (gloo's and NCCL's warnings, written to
fd 2 by c10's logging), ``faulthandler``. Those write straight to the
process's file descriptors 1 and 2.

``FdCapture`` does what ipykernel's ``watchfd`` does for a kernel: it points
fd 1 and fd 2 at the write ends of two pipes (``dup2``), and a reader thread
hands what arrives to a sink, ``sink(stream, text)``, with ``stream`` being
``"stdout"`` or ``"stderr"``. Child processes inherit the pipes, so their output
is captured too.

Order. A pipe is a queue of bytes that another thread reads a moment later,
so a C-level write lands among the rank's ``print`` calls where the reader
delivered it: usually where it was written, but ``os.write(1, b'a\\n');
print('b')`` can come out as ``b a``, and two runs can differ. That is the
limit of capturing at the descriptor, and ipykernel's ``watchfd`` has it too.
Exact order would need a look at the pipes before every ``print`` (a system
call per write: a 100k-line print loop would get measurably slower), or
signal-driven pipes (``O_ASYNC``), which we tried and dropped: the signal cuts
the main thread's own large writes short (``os.write`` returns early), which
changes what student code does.

What is deterministic: ``drain()`` runs when a cell starts (what came before
belongs to the time between cells) and when it ends, before the cell's result
goes back. It flushes Python's and C's own buffers of fd 1 and 2, then reads
every byte already in the pipes, so the tail is never lost. Text on one
descriptor keeps its order; a cell whose output all comes from one place (a
subprocess, gloo, ``os.write``) stores the same text on every run; and all of
it shows under its rank's label, in rank order.
"""

from __future__ import annotations

import codecs
import ctypes
import fcntl
import logging
import os
import select
import sys
import threading
from typing import Callable

#: Bytes read at a time; the pipes are made this large where the system allows.
CHUNK = 1 << 20
STREAMS = {1: "stdout", 2: "stderr"}


_libc: list = []                 # the C library, loaded once


def _flush_c_stdio() -> None:
    """Flush C's ``stdout``/``stderr`` buffers (``printf`` in a C extension)."""
    try:
        if not _libc:
            _libc.append(ctypes.CDLL(None))
        _libc[0].fflush(None)
    except (OSError, AttributeError):
        pass


class FdCapture:
    """Routes fd 1 and 2 of this process through pipes into ``sink(stream, text)``.

    ``sink`` is called from the reader thread, or from the thread calling
    ``drain``, never from two at once (``lock`` is held around it).
    """

    def __init__(self, sink: Callable[[str, str], None]) -> None:
        self.sink = sink
        self.lock = threading.Lock()
        self._pipes: dict[int, int] = {}          # read end -> fd it captures (1 or 2)
        self._saved: dict[int, int] = {}          # fd -> a copy of what it pointed at before
        self._decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in STREAMS}
        self._owner = os.getpid()
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="ddplab-fd-reader", daemon=True)
        self._closing = False
        self.error = ""                           # the last exception the sink raised, for tests

    def start(self) -> "FdCapture":
        """Point fd 1 and 2 at the pipes and start the reader. Returns self."""
        for fd in STREAMS:
            _flush_python(fd)
            read_end, write_end = os.pipe()
            try:
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, CHUNK)   # fewer, larger reads
            except (OSError, AttributeError):
                pass
            os.set_blocking(read_end, False)      # the read end only: writers still block
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)                # inheritable: child processes write here too
            os.close(write_end)
            self._pipes[read_end] = fd
        self._keep_logs_in_log_file()
        os.register_at_fork(after_in_child=self._forget_in_child)
        self._thread.start()
        return self

    def _keep_logs_in_log_file(self) -> None:
        """The engine's own log lines ("Handling apply_request") stay in its log file.

        ipykernel does the same when it captures descriptors. A handler the
        student makes later writes to ``sys.stderr``, the recorder.
        """
        loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                          if isinstance(logger, logging.Logger))]
        for logger in loggers:
            for handler in logger.handlers:
                if type(handler) is not logging.StreamHandler:
                    continue
                try:
                    fd = handler.stream.fileno()
                except (AttributeError, OSError, ValueError):
                    continue
                if fd in self._saved:
                    handler.setStream(open(self._saved[fd], "w", buffering=1, closefd=False))

    def _forget_in_child(self) -> None:
        # A forked child shares the pipes (its writes are captured by us, the
        # parent) but not the reader thread; a lock held at the fork stays held.
        self.lock = threading.Lock()

    def _run(self) -> None:
        watched = [*self._pipes, self._wake_read]
        while not self._closing:
            try:
                ready, _, _ = select.select(watched, [], [])
            except OSError:
                return
            with self.lock:
                for read_end in ready:
                    if read_end in self._pipes:
                        self._read(read_end, CHUNK)

    def _read(self, read_end: int, limit: int) -> int:
        """Hand what is in one pipe now (at most ``limit`` bytes) to the sink; bytes read."""
        fd, taken = self._pipes[read_end], 0
        while taken < limit:
            try:
                data = os.read(read_end, CHUNK)
            except BlockingIOError:
                break
            if not data:
                break
            taken += len(data)
            text = self._decoders[fd].decode(data)
            if text:
                try:
                    self.sink(STREAMS[fd], text)
                except Exception as exc:    # keep reading, or the writers would block forever
                    self.error = repr(exc)
        return taken

    def drain(self) -> None:
        """Deliver everything written to fd 1 and 2 before this call (see the module docstring).

        Reads at most one pipe's capacity past what was there: a writer that
        keeps writing meanwhile cannot keep this call from returning.
        """
        if os.getpid() != self._owner:
            return
        for fd in STREAMS:
            _flush_python(fd)
        _flush_c_stdio()
        with self.lock:
            for read_end in self._pipes:
                self._read(read_end, 2 * CHUNK)

    def close(self) -> None:
        """Point fd 1 and 2 back where they pointed, deliver the rest, stop the reader."""
        self.drain()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._closing = True
        os.write(self._wake_write, b"x")
        self._thread.join(5)
        with self.lock:
            for read_end in self._pipes:
                self._read(read_end, 1 << 62)
                os.close(read_end)
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._pipes, self._saved = {}, {}


def _flush_python(fd: int) -> None:
    """Flush Python's own file object on ``fd`` (``sys.__stdout__``), if it buffers anything."""
    stream = sys.__stdout__ if fd == 1 else sys.__stderr__
    try:
        if stream is not None:
            stream.flush()
    except (OSError, ValueError):
        pass
