"""debugpy on a rank, reached through a Unix socket in the lab's private folder.

What ``lab.debugpy(ranks=[1])`` runs on each rank it names (the kernel's side,
the port VS Code attaches to and ``.vscode/launch.json``, is
``ddplab.lab.debugpy_attach``):

- ``listen(path)`` starts debugpy *in this process* (pydevd speaks the Debug
  Adapter Protocol itself: ``in_process_debug_adapter=True``, so no adapter
  process is spawned) on 127.0.0.1 with a free port. A local lab's ranks live
  in a network of their own (``ddplab.rank.netns``): that port is not the
  machine's 127.0.0.1, and no one outside the lab can connect to it, VS Code
  included. So ``listen`` also opens a Unix socket at ``path``, in the lab's
  0700 folder (a file path reaches across network namespaces, as the
  controller's sockets do), and joins each connection made there to
  debugpy's port: the kernel's forwarder connects here.
- ``wait()`` blocks until a client has attached (and sent
  ``configurationDone``), so a breakpoint set in VS Code is in place before
  the code runs.
- ``end()`` closes the Unix socket and stops debugpy's tracing
  (``pydevd.stoptrace``: the rank runs at full speed again). debugpy can
  start only once per process (``debugpy.listen`` refuses a second call) and
  has no public way to stop listening: its port, inside the lab's own
  network, stays open until the rank ends, out of everyone's reach once the
  Unix socket is gone. A second session on this rank needs a fresh process:
  ``used()`` says so, and the kernel asks for ``lab.restart()``.

While a session is open, the builtin ``breakpoint()`` on the rank stops in
VS Code (``debugpy.breakpoint()``), not in the notebook's pdb prompt.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)
_state: dict[str, Any] = {"server": None, "port": None, "used": False, "hook": None,
                          "links": []}


def used() -> bool:
    """Whether debugpy already ran in this process (it cannot start twice)."""
    return bool(_state["used"])


def listen(path: str) -> None:
    """Start debugpy on this rank's loopback and a bridge to it from the Unix socket ``path``."""
    if _state["used"]:
        raise RuntimeError("ddplab: debugpy already ran on this rank, and it starts only once "
                           "per process. Recover with: lab.restart()")
    _state["used"] = True
    # pydevd warns on stderr about frozen modules at start; the rank's output is the user's.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    import debugpy

    # subProcess off: pydevd would patch subprocess and multiprocessing in this rank.
    debugpy.configure(subProcess=False)
    _host, _state["port"] = debugpy.listen(("127.0.0.1", 0), in_process_debug_adapter=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)          # the socket file owner-only from its first moment
    try:
        server.bind(path)
    finally:
        os.umask(old_umask)
    server.listen(2)
    _state["server"], _state["path"] = server, path
    threading.Thread(target=_accept, args=(server,), name="ddplab-debugpy-bridge",
                     daemon=True).start()          # before _untraced: it is one of ours
    _state["hook"] = sys.breakpointhook
    sys.breakpointhook = debugpy.breakpoint
    _untraced()


def wait() -> None:
    """Block until a debug client has attached (its breakpoints are set by then)."""
    import debugpy
    _untraced()
    debugpy.wait_for_client()


def _untraced() -> None:
    """Keep debugpy off the threads running now: the engine's and ddplab's, this bridge's.

    At a breakpoint debugpy suspends every thread it traces. Suspended, the
    bridge could not carry its ``stopped`` event to VS Code, and the engine's
    heartbeat would stop (the controller then declares the rank dead). The
    user's own threads, started later, are traced as usual.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.pydev_do_not_trace = True          # pydevd's own marks for its threads
            thread.is_pydev_daemon_thread = True


def end() -> None:
    """Close the bridge, stop tracing; the builtin ``breakpoint()`` is the notebook's pdb again."""
    server = _state["server"]
    if server is None:
        return
    _state["server"] = None
    try:
        server.shutdown(socket.SHUT_RDWR)     # wakes _accept: a bare close() would not
    except OSError:
        log.debug("the bridge was not listening", exc_info=True)
    server.close()
    try:
        os.unlink(_state["path"])
    except FileNotFoundError:
        pass
    for link in _state["links"]:
        _close(link)
    _state["links"].clear()
    if _state["hook"] is not None:
        sys.breakpointhook, _state["hook"] = _state["hook"], None
    # debugpy's own copy of pydevd, imported by listen(): not a distribution of its own.
    sys.modules["pydevd"].stoptrace()


def _accept(server: socket.socket) -> None:
    while True:
        try:
            front, _ = server.accept()
        except OSError:
            return                        # end() closed the server
        try:
            back = socket.create_connection(("127.0.0.1", _state["port"]), timeout=10)
            back.settimeout(None)
        except OSError:
            log.debug("debugpy's port refused the bridge", exc_info=True)
            _close(front)
            continue
        _state["links"] += [front, back]
        for a, b in ((front, back), (back, front)):
            thread = threading.Thread(target=pump, args=(a, b), name="ddplab-debugpy-pump",
                                      daemon=True)
            thread.pydev_do_not_trace = thread.is_pydev_daemon_thread = True   # see _untraced
            thread.start()


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes from ``source`` to ``sink`` until either closes; then close both ways."""
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass                              # the other side closed: the link is over
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        log.debug("closing a bridge socket", exc_info=True)
