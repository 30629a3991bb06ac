"""Engines on SSH hosts: one ssh session per host, all hosts at once, nothing left behind.

ipyparallel's ``SSHEngineSetLauncher`` starts engines one after another, each
with about six ssh round trips (shell check, python check, ``ipython profile
create``, mkdir, scp, start), copies with a bare ``scp`` that ignores
``ssh_cmd``, and leaves the remote profile directory behind. This launcher
(an ipyparallel engine launcher, so ``Cluster`` drives it as any other) opens
one ``ssh_cmd HOST REMOTE_PYTHON -c AGENT`` per host, all at once, while the
controller is still starting. The agent, a few lines of standard-library
Python on the host:

1. reads one line from the kernel: the engine connection file, the command
   and the environment, sent once the controller has written the file;
2. makes a private directory of its own (``mkdtemp``: 0700; the file 0600),
   starts the host's engines in it (``TMPDIR`` too, so whatever a rank
   writes there goes with it) and says their pids;
3. says at once when an engine exits, with the end of its output, so a start
   that cannot work fails with the cause (``No module named 'ddplab'``);
4. on end of input (``stop()`` closed it, or the kernel died and took the ssh
   client with it) ends its engines, removes its directory and exits.

ssh's own failures (a name that does not resolve, a host key not trusted, a
refused key) end the session: its stderr is the cause.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import threading
import time
from typing import Any

from ipyparallel.cluster import launcher as ipp_launcher

from ... import procs

log = logging.getLogger(__name__)

#: Runs on each host under ``remote_python``: standard library only (it must run, and report,
#: where ddplab is missing). Messages are JSON lines on stdout.
AGENT = r'''
import json, os, shutil, signal, subprocess, sys, tempfile, threading, time
def say(**m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
cfg = json.loads(sys.stdin.readline() or "null")
if not cfg:
    sys.exit(0)
d = tempfile.mkdtemp(prefix="ddplab-host-")
os.makedirs(os.path.join(d, "security"), mode=0o700)
for rel, text in cfg["files"].items():
    fd = os.open(os.path.join(d, rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
env = dict(os.environ, **cfg["env"])
env.update(TMPDIR=d, IPP_PROFILE_DIR=d, DDPLAB_PARENT_PID=str(os.getpid()))
procs, logs = [], []
for i in range(cfg["n"]):
    logs.append(os.path.join(d, "engine-%d.log" % i))
    with open(logs[-1], "wb") as out:
        procs.append(subprocess.Popen(cfg["cmd"] + ["--profile-dir=" + d], stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, cwd=d, start_new_session=True))
say(dir=d, pids=[p.pid for p in procs])
stopping = False
def watch():
    told = set()
    while not stopping:
        for i, p in enumerate(procs):
            if i not in told and p.poll() is not None:
                told.add(i)
                with open(logs[i], "rb") as f:
                    tail = f.read()[-3000:].decode("utf-8", "replace")
                if not stopping:
                    say(exit=i, pid=p.pid, code=p.returncode, output=tail)
        time.sleep(0.2)
threading.Thread(target=watch, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *a: sys.stdin.close())
try:
    sys.stdin.read()
except Exception:
    pass
stopping = True
for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except OSError:
                pass
    end = time.monotonic() + wait
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
shutil.rmtree(d, ignore_errors=True)
say(stopped=d)
'''


class HostSession:
    """One host's ssh session to its agent, seen from the kernel."""

    def __init__(self, host: str, n: int, ssh_cmd: list[str], remote_python: str) -> None:
        self.host, self.n = host, n
        remote = f"{shlex.quote(remote_python)} -u -c {shlex.quote(AGENT)}"
        # ipyparallel's spelling of a port, user@host:port, is ssh's -p.
        destination, _, port = host.partition(":")
        self.args = [*ssh_cmd, *(["-p", port] if port else []), destination, remote]
        self.dir: str | None = None
        self.pids: list[int] = []
        self.exits: list[dict] = []
        self.stopped = False
        self.stderr = ""
        self.proc = procs.start(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        self._readers = [threading.Thread(target=self._read, daemon=True,
                                          name=f"ddplab-ssh-{host}"),
                         threading.Thread(target=self._read_err, daemon=True,
                                          name=f"ddplab-ssh-err-{host}")]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                try:
                    m = json.loads(line)
                except ValueError:
                    continue             # a login banner or the like
                if "dir" in m:
                    self.dir, self.pids = m["dir"], m["pids"]
                elif "exit" in m:
                    self.exits.append(m)
                elif "stopped" in m:
                    self.stopped = True
        except (OSError, ValueError):
            log.debug("reading the ssh session to %s ended", self.host, exc_info=True)

    def _read_err(self) -> None:
        try:
            for line in self.proc.stderr:
                self.stderr += line.decode("utf-8", "replace")
        except (OSError, ValueError):
            log.debug("reading ssh's stderr for %s ended", self.host, exc_info=True)

    def send(self, config: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(config) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass                         # ssh is gone already: failure() says why

    def failure(self) -> str | None:
        """Why this host's engines cannot all be up, or None while they may be."""
        if self.exits:
            e = self.exits[0]
            return (f"an engine on {self.host} (pid {e['pid']}) exited with code {e['code']}. "
                    f"Its output:\n{e['output'].rstrip()}")
        code = self.proc.poll()
        if code is not None:
            for t in self._readers:
                t.join(1)
            return (f"`{shlex.join(self.args[:-1])} ...` exited with code {code} before the "
                    f"engines on {self.host} started. ssh said:\n{self.stderr.strip() or '(nothing)'}")
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Ask the agent to end its engines and remove its directory; wait for it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("ddplab: the ssh session to %s did not end in %g s; ending it", self.host,
                        timeout)
            procs.end_tree(self.proc, grace=0)
            self.proc.wait(5)
        for t in self._readers:
            t.join(1)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


class SSHEngineSetLauncher(ipp_launcher.SSHEngineSetLauncher):
    """ipyparallel's SSH engine launcher, configured as it is (``engines={host: n}``, ``ssh_cmd``,
    ``remote_python``: ``launch`` sets it), that starts every host's engines at once through
    one ssh session each."""
    file_timeout = 60.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sessions: list[HostSession] = []
        self._sender: threading.Thread | None = None
        self._send_error = ""

    def find_args(self) -> list[str]:
        return [*self.ssh_cmd, "(one session per host)"]

    def start(self, n: int) -> list[str]:
        """Open every host's session at once; send the engines' part once the controller wrote it."""
        self.n = sum(self.engines.values())
        self.sessions = [HostSession(h, k, list(self.ssh_cmd), self.remote_python)
                         for h, k in self.engines.items()]
        self.notify_start([s.host for s in self.sessions])
        self._sender = threading.Thread(target=self._send_when_ready, daemon=True,
                                        name="ddplab-ssh-send")
        self._sender.start()
        return [s.host for s in self.sessions]

    def _send_when_ready(self) -> None:
        path = self.connection_files["engine"]
        deadline = time.monotonic() + self.file_timeout
        text = ""
        while time.monotonic() < deadline and self.state == "running":
            try:
                with open(path) as f:
                    text = f.read()
                json.loads(text)
                break
            except (OSError, ValueError):
                text = ""
                time.sleep(0.05)
        if not text:
            self._send_error = f"the controller wrote no {path} within {self.file_timeout:g} s"
            return
        rel = os.path.relpath(path, self.profile_dir)
        cmd = [*self.engine_cmd, f"--cluster-id={self.cluster_id}", *self.engine_args]
        for s in self.sessions:
            s.send({"n": s.n, "cmd": cmd, "env": dict(self.environment), "files": {rel: text}})

    def failure(self) -> str | None:
        """The first reason why the engines cannot all start, or None."""
        if self._send_error:
            return self._send_error
        for s in self.sessions:
            why = s.failure()
            if why:
                return why
        return None

    @property
    def remote_dirs(self) -> dict[str, str | None]:
        return {s.host: s.dir for s in self.sessions}

    @property
    def remote_pids(self) -> dict[str, list[int]]:
        return {s.host: list(s.pids) for s in self.sessions}

    def signal(self, sig: int) -> None:
        # Signals cannot cross hosts from here; the engines' nanny takes them (client.send_signal).
        log.debug("ddplab: signal %s to SSH engines is not sent", sig)

    async def stop(self) -> None:
        self.stop_sync()

    def stop_sync(self) -> None:
        """End every host's engines and remove their directories (all hosts at once)."""
        sessions, self.sessions = self.sessions, []
        threads = [threading.Thread(target=s.close) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.notify_stop({"exit_code": 0, "hosts": [s.host for s in sessions]})

    def get_output(self, remove: bool = False) -> str:
        return "\n".join(f"{s.host}: {s.stderr}" for s in self.sessions if s.stderr)
