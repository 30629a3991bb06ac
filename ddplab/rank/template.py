"""A warm template process that forks engines: each rank costs a fork, not an import.

Importing torch takes about 1.5 s of CPU. A lab of four ranks started as four
fresh Python processes imports it four times, on a laptop's two cores at once.
The template imports torch (and ipyparallel's engine) once, then forks one
child per engine it is asked for; a fork copies the imported modules for free.

    python -m ddplab.rank.template DIR/fork.sock     # started by ddplab.lab.template

It listens on that Unix socket, in a private (0700) directory of its own, so
no other user can ask it for anything; it removes the directory when it exits. One
request per connection, one JSON line:
``{"argv": [...], "env": {...}, "cwd": "...", "output": "...", "lab_dir": "...", "owner": PID}``;
the answer is
``{"pid": N}`` once the child exists. ``{"status": N}`` asks how child N ended
(``{"exit": code}`` or ``{"signal": number}``, ``{}`` while it runs).
``{"network": 1}`` asks whether the ranks have a network of their own:
``{"shared_because": ""}`` if they do (``ddplab.rank.netns``), else why not.

Why this is safe to fork from (the known pitfalls):
- No threads: the template never starts one (its parent watch is a poll in the
  accept loop), and importing torch starts none; forking a process with threads
  can copy a lock that another thread held, and the child would hang on it.
- No OpenMP pool: the template runs no torch operation, so no thread pool
  exists yet; each child sets its own thread count (``OMP_NUM_THREADS``) before
  its first operation.
- No CUDA: nothing here touches the GPU, and CUDA cannot be used after a fork
  once it was initialised in the parent.
- It dies with the kernel: it polls its parent every half second, and when the
  kernel is gone it ends its children and exits. The children watch the
  template the same way (``ddplab.rank.tether``).
- Shared by ``ddplab grade`` (its parent is then the grader), it also polls
  each kernel that asked it for engines (``owner`` in the request): when one
  dies, its engines are ended and its labs' directories removed, as if that
  kernel had had a template of its own.

When the kernel dies it also removes the directories of the labs whose engines
it forked (``lab_dir``). The controller's tether does that too, but a kernel
killed halfway through its exit, after it ended the controller and before it
removed the directory itself, leaves only the template to do it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time

POLL_SECONDS = 0.5
_ended: dict[int, dict] = {}      # pid -> how it ended, for {"status": pid}
_children: set[int] = set()
_lab_dirs: set[str] = set()       # the directories of the labs we forked engines for
_owners: dict[int, "_Owner"] = {}  # kernels other than our parent that we fork for (ddplab grade)
_parent_pid = 0
_network = "not asked for"        # why the ranks share the machine's network ("" if they do not)


class _Owner:
    """A kernel that borrows this template: its engines and lab directories, ended when it dies."""

    def __init__(self, pid: int) -> None:
        import psutil
        try:
            self.process: object = psutil.Process(pid)   # pid and start time: no pid reuse
        except psutil.Error:
            self.process = None
        self.children: set[int] = set()
        self.lab_dirs: set[str] = set()

    def alive(self) -> bool:
        from ddplab import procs
        return procs.alive(self.process)

    def end(self) -> None:
        from ddplab import procs
        procs.Tree([pid for pid in self.children if pid in _children], sessions=True).end(grace=0)
        for lab_dir in self.lab_dirs:
            shutil.rmtree(lab_dir, ignore_errors=True)


def _reap(*_: object) -> None:
    """Collect every child that has ended, so none stays a zombie."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _children.discard(pid)
        for owner in _owners.values():     # a pid the OS hands out again is someone else's
            owner.children.discard(pid)
        _ended[pid] = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                       else {"exit": os.WEXITSTATUS(status)})


def _status(pid: int, patience: float = 2.0) -> dict:
    """How child ``pid`` ended; ``{}`` if it is not our child or is still running.

    The kernel asks once it sees the process gone, which can be a moment early: the
    main thread of a multi-threaded process shows as a zombie while its other threads
    still exit, and until they have, ``waitpid`` cannot collect it. So wait a little.
    """
    deadline = time.monotonic() + patience
    _reap()
    while pid in _children and pid not in _ended and time.monotonic() < deadline:
        time.sleep(0.01)
        _reap()
    return _ended.get(pid, {})


def _become(request: dict) -> None:
    """In the forked child: turn into the process ``argv`` describes. Never returns."""
    try:
        os.setsid()                        # its own session, as procs.start gives a command
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(devnull)
        os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["DDPLAB_PARENT_PID"] = str(os.getppid())   # the tether watches the template
        os.chdir(request["cwd"] or "/")
        # What torch read from the environment at import time, read again for this rank.
        import torch
        import torch.distributed as dist
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
        dist.set_debug_level_from_env()          # TORCH_DISTRIBUTED_DEBUG
        argv = request["argv"]
        # argv is [python, "-m", "ddplab.rank.tether", MODULE, ARGS...]: run the tether here.
        if argv[1:3] != ["-m", "ddplab.rank.tether"]:
            raise ValueError(f"the template only runs ddplab.rank.tether, not {argv!r}")
        from ddplab.rank import tether
        tether.main(argv[3:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _answer(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as stream:
        line = stream.readline()
        if not line:
            return
        request = json.loads(line)
        if "status" in request:
            reply = _status(int(request["status"]))
        elif "network" in request:
            reply = {"shared_because": _network}
        else:
            pid = os.fork()
            if pid == 0:
                _become(request)
            _children.add(pid)
            if request.get("lab_dir"):
                _lab_dirs.add(request["lab_dir"])
            owner = int(request.get("owner") or 0)
            if owner and owner != _parent_pid:
                record = _owners.get(owner)
                if record is not None and not record.alive():
                    record.end()           # that kernel died and its pid was reused already
                    record = None
                if record is None:
                    record = _owners[owner] = _Owner(owner)
                record.children.add(pid)
                if request.get("lab_dir"):
                    record.lab_dirs.add(request["lab_dir"])
            reply = {"pid": pid}
        stream.write(json.dumps(reply).encode() + b"\n")
        stream.flush()


def _end_orphans() -> None:
    """End the engines of every borrowing kernel that has died, and remove its labs' directories."""
    for pid, owner in list(_owners.items()):
        if not owner.alive():
            owner.end()
            del _owners[pid]


def _end_children() -> None:
    from ddplab import procs
    # Each child leads its own session: end everything still in those sessions, at once.
    procs.Tree(list(_children), sessions=True).end(grace=0)


def serve(path: str, parent_pid: int) -> None:
    """Answer fork requests on the Unix socket ``path`` until the parent (the kernel) is gone."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)                  # the socket file: owner only
    try:
        server.bind(path)
    finally:
        os.umask(old)
    server.listen(64)
    server.settimeout(POLL_SECONDS)
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    global _parent_pid
    _parent_pid = parent_pid
    print("ready", flush=True)             # the kernel waits for this line
    from ddplab.procs import parent_gone
    try:
        while not parent_gone(parent_pid):
            try:
                conn, _ = server.accept()
            except TimeoutError:
                _end_orphans()
                continue
            conn.settimeout(None)
            _answer(conn)
            _end_orphans()
    finally:
        _end_children()
        server.close()
        if parent_gone(parent_pid):        # the kernel died; after a SIGTERM, it cleans up itself
            for lab_dir in _lab_dirs:
                shutil.rmtree(lab_dir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def preload() -> None:
    """Import what every engine imports, once, so each fork starts warm."""
    import ipyparallel.engine.app  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import ddplab.rank.engine  # noqa: F401
    import ddplab.rank.tether  # noqa: F401


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m ddplab.rank.template SOCKET")
    parent = int(os.environ.get("DDPLAB_PARENT_PID", os.getppid()))
    # First, while this process has one thread: a network of the lab's own (see netns).
    from ddplab.rank import netns
    global _network
    _network = netns.enter_private_network(os.path.dirname(argv[0])) or ""
    preload()
    try:
        serve(argv[0], parent)
    except SystemExit:                     # SIGTERM: serve's clean-up has run
        pass
    sys.stdout.flush()
    # Skip the interpreter's teardown: with torch loaded it takes seconds (2.6 s on a
    # busy 2-core laptop), which every lab.stop() and a kernel shutting down wait for.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
