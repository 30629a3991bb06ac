"""VS Code attached to ranks: ``with lab.debugpy(ranks=[1]):`` and ``%%rank 1 --debugpy``.

The chosen ranks start debugpy (``ddplab.rank.debugpy_bridge``), and this
kernel gives each one a port VS Code can reach::

    VS Code --TCP 127.0.0.1:PORT--> kernel's forwarder --Unix socket, lab's 0700 folder-->
        the rank's bridge --TCP 127.0.0.1 in the lab's own network--> debugpy (pydevd, in process)

- **Loopback only, this kernel's.** A local lab's ranks live in a network of
  their own (``ddplab.rank.netns``): debugpy's port there is out of reach of
  this machine, VS Code included. The forwarder, a thread of this kernel,
  listens on the machine's 127.0.0.1 at a free port per rank, while the
  session lasts. A lab whose ranks share the machine's network (no network
  namespace) is refused: debugpy's own port, which cannot be closed inside
  a process, would stay open there for every user of the machine.
- **launch.json.** ``.vscode/launch.json`` (in the kernel's working folder)
  gets one ``attach`` configuration per rank, ``ddplab: rank 1``, and a
  compound ``ddplab: attach to ranks`` that attaches to all of them; other
  configurations in the file are kept.
- **Waiting.** Entering waits (no timeout; Kernel > Interrupt ends it) until
  VS Code has attached to every chosen rank, so its breakpoints are in place
  before any code runs. Inside, the lab's calls wait without the lab's
  timeout (a rank may stop at a breakpoint for minutes) unless one is given;
  a rank waiting for the stopped one in a collective shows ``blocked in
  barrier`` in the live status, as with ``ddplab.breakpoint()``.
- **This user only.** 127.0.0.1 is every local user's, and a debugger runs
  any code in the rank: the forwarder takes a connection only from a
  process of the kernel's own user (``mine``: its uid in ``/proc/net/tcp``).
- **Afterwards nothing listens.** Leaving closes the forwarders and the
  ranks' Unix sockets, and stops debugpy's tracing on the ranks. debugpy
  starts once per process, so a second session on the same rank asks for
  ``lab.restart()`` first.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any

from ..errors import ConfigError
from ..rank import debugpy_bridge, engine
from . import display

log = logging.getLogger(__name__)
#: The compound configuration in launch.json that attaches to every chosen rank.
COMPOUND = "ddplab: attach to ranks"


class Forwarder:
    """A TCP port on this machine's loopback, each connection joined to a Unix socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self._links: list[socket.socket] = []
        threading.Thread(target=self._accept, name="ddplab-debugpy-forward", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                front, _ = self.server.accept()
            except OSError:
                return                     # close(): the session is over
            if not mine(front):
                display.say(f"ddplab: refused a debugger connection to port {self.port} from "
                            f"another user of this machine.")
                front.close()
                continue
            back = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                back.connect(self.path)
            except OSError:
                log.debug("the rank's debugpy bridge is gone", exc_info=True)
                front.close()
                back.close()
                continue
            self._links += [front, back]
            for a, b in ((front, back), (back, front)):
                threading.Thread(target=debugpy_bridge.pump, args=(a, b), daemon=True,
                                 name="ddplab-debugpy-pump").start()

    def close(self) -> None:
        # shutdown first: on Linux a close() leaves a listener blocked in accept() listening.
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            log.debug("the forwarder was not listening", exc_info=True)
        self.server.close()
        for link in self._links:
            try:
                link.close()
            except OSError:
                log.debug("closing a forwarded connection", exc_info=True)


def mine(connection: socket.socket) -> bool:
    """Whether the loopback client at the other end of ``connection`` runs as this user.

    127.0.0.1 is shared by every user of the machine, and a debugger runs any
    code it likes in the rank. Linux lists each TCP socket with its owner's
    uid in ``/proc/net/tcp``: the client's socket is the one whose local
    address is the connection's peer. Where that cannot be read, refuse.
    """
    def hex_address(address: tuple) -> str:
        host, port = address[:2]
        return socket.inet_aton(host)[::-1].hex().upper() + f":{port:04X}"

    try:
        client, server = hex_address(connection.getpeername()), hex_address(connection.getsockname())
        with open("/proc/net/tcp", encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1] == client and fields[2] == server:
                    return int(fields[7]) == os.getuid()
    except (OSError, ValueError, IndexError):
        log.debug("could not tell who connected", exc_info=True)
    return False


def write_launch_json(folder: str, ports: dict[int, int]) -> str:
    """Put the ranks' attach configurations and the compound into ``folder/.vscode/launch.json``."""
    path = os.path.join(folder, ".vscode", "launch.json")
    config: dict[str, Any] = {"version": "0.2.0", "configurations": [], "compounds": []}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as e:            # VS Code allows comments; json does not
            raise ConfigError(f"ddplab: {path} is not plain JSON ({e}), so lab.debugpy cannot "
                              f"add its configurations to it. Remove its comments, or move it "
                              f"aside.") from None
    ours = {f"ddplab: rank {rank}" for rank in ports}
    config["configurations"] = [c for c in config.get("configurations", [])
                                if not str(c.get("name", "")).startswith("ddplab: rank ")]
    config["configurations"] += [
        {"name": f"ddplab: rank {rank}", "type": "debugpy", "request": "attach",
         "connect": {"host": "127.0.0.1", "port": port}, "justMyCode": False}
        for rank, port in sorted(ports.items())]
    config["compounds"] = [c for c in config.get("compounds", []) if c.get("name") != COMPOUND]
    config["compounds"].append({"name": COMPOUND, "configurations": sorted(ours)})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path


class Block:
    """What ``lab.debugpy(...)`` returns: a ``with`` block that says so if it is never entered.

    Called as a statement, a context manager does nothing, silently: ``lab.debugpy(ranks=1)``
    alone attached nothing. This one says what to write, when the notebook shows it (the
    cell's last line) or when it is dropped unused (any other line).
    """

    def __init__(self, inner: Any, spelled: str, ranks: list[int]) -> None:
        self.inner, self.spelled, self.ranks = inner, spelled, ranks
        self.told = self.entered = False

    def __enter__(self) -> None:
        self.entered = True
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)

    def advice(self) -> str:
        return (f"ddplab: {self.spelled} did nothing: it is a with-block, entered only by `with`. "
                f"Write\n    with lab.debugpy(ranks={self.ranks}):\n        lab.run(fn)   # or "
                f"any calls to debug\nor run one cell under VS Code with %%ranks --debugpy "
                f"{' '.join(map(str, self.ranks))}.")

    def __repr__(self) -> str:
        if self.entered:
            return f"<{self.spelled}>"
        self.told = True
        return self.advice()

    def __del__(self) -> None:
        if not self.entered and not self.told:
            display.say(self.advice())


class Session:
    """One ``lab.debugpy(...)`` block: see this module's docstring."""

    def __init__(self, calls: Any, ranks: list[int], network_shared_because: str | None,
                 folder: str = ".") -> None:
        if network_shared_because is None:
            raise ConfigError("ddplab: lab.debugpy works on a lab started on this machine "
                              "(ddplab.start); this lab's ranks are elsewhere.")
        if network_shared_because:
            raise ConfigError(f"ddplab: lab.debugpy needs ranks in a network of their own, but "
                              f"they share this machine's, because {network_shared_because}: "
                              f"debugpy's port would be open to every user here. Use "
                              f"ddplab.breakpoint() (pdb in the notebook) instead.")
        self.calls, self.ranks, self.folder = calls, ranks, folder
        self.forwarders: dict[int, Forwarder] = {}

    def __enter__(self) -> "Session":
        directory = self.calls.engines.directory
        paths = {rank: os.path.join(directory, f"debugpy-rank{rank}.sock") for rank in self.ranks}
        tasks = [self.calls.call(rank, engine.call, debugpy_bridge.listen, (paths[rank],), {})
                 for rank in self.ranks]
        try:
            self.calls.finish(tasks, 60, grace=None)
            self.forwarders = {rank: Forwarder(paths[rank]) for rank in self.ranks}
            ports = {rank: f.port for rank, f in self.forwarders.items()}
            where = write_launch_json(self.folder, ports)
            display.say("\n".join(
                [f"ddplab: rank {rank} waits for VS Code on 127.0.0.1:{port}"
                 for rank, port in sorted(ports.items())]
                + [f"In VS Code: Run and Debug > '{COMPOUND}' ({where}). Kernel > Interrupt "
                   f"stops waiting."]))
            tasks = [self.calls.call(rank, engine.call, debugpy_bridge.wait, (), {})
                     for rank in self.ranks]
            self.calls.finish(tasks, float("inf"), grace=None)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for forwarder in self.forwarders.values():
            forwarder.close()
        self.forwarders = {}
        try:
            self.calls.ensure_usable()
            tasks = [self.calls.call(rank, engine.call, debugpy_bridge.end, (), {})
                     for rank in self.ranks]
            self.calls.finish(tasks, 30, grace=None)
        except Exception:
            # A hung or broken lab: lab.restart() ends the ranks, their sockets with them.
            log.debug("debugpy could not be stopped on the ranks", exc_info=True)
