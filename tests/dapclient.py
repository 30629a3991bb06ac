"""A small Debug Adapter Protocol client: what VS Code sends to debugpy, hand-written for tests.

DAP is JSON framed by a ``Content-Length`` header over a socket. A session as
VS Code's "attach" runs it: ``initialize``, ``attach``, ``setBreakpoints``,
``configurationDone``; then, once an event says ``stopped``, ``stackTrace``,
``scopes``, ``variables``; ``continue``; ``disconnect``. Events (``output``,
``thread``, ``stopped``...) may come between a request and its response, so
every read keeps them for ``wait_event``.
"""

from __future__ import annotations

import json
import socket
import time


class DapClient:
    """One DAP session over TCP; each request returns its response's ``body``."""

    def __init__(self, host: str, port: int, timeout: float = 30) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.timeout = timeout
        self._buffer = b""
        self._seq = 0
        self.events: list[dict] = []
        self._responses: dict[int, dict] = {}   # responses read while waiting for another

    def close(self) -> None:
        self.sock.close()

    # -- framing
    def _send(self, message: dict) -> None:
        body = json.dumps(message).encode("utf-8")
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def _read(self, deadline: float) -> dict:
        while True:
            head, sep, rest = self._buffer.partition(b"\r\n\r\n")
            if sep:
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                if len(rest) >= length:
                    self._buffer = rest[length:]
                    return json.loads(rest[:length])
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"the debug adapter closed the connection; events so far: "
                               f"{[e.get('event') for e in self.events]}")
            self._buffer += chunk

    # -- requests and events
    def send(self, command: str, **arguments) -> int:
        """Send a request, not waiting; its sequence number (for ``response``)."""
        self._seq += 1
        self._send({"seq": self._seq, "type": "request", "command": command,
                    "arguments": arguments})
        return self._seq

    def response(self, seq: int) -> dict:
        """Wait for the response to request ``seq``; its body (fails the test if refused)."""
        deadline = time.monotonic() + self.timeout
        while seq not in self._responses:
            self._keep(self._read(deadline))
        message = self._responses.pop(seq)
        assert message.get("success"), f"{message.get('command')} refused: {message}"
        return message.get("body") or {}

    def _keep(self, message: dict) -> None:
        if message.get("type") == "event":
            self.events.append(message)
        elif message.get("type") == "response":
            self._responses[message.get("request_seq")] = message

    def request(self, command: str, **arguments) -> dict:
        return self.response(self.send(command, **arguments))

    def wait_event(self, name: str, limit: float | None = None) -> dict:
        """The first event ``name`` not yet taken, waiting for it if need be; its body."""
        deadline = time.monotonic() + (limit or self.timeout)
        while True:
            for i, event in enumerate(self.events):
                if event.get("event") == name:
                    return self.events.pop(i).get("body") or {}
            self._keep(self._read(deadline))
