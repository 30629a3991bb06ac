"""A real JupyterHub for tests/test_hub.py: its students, their cgroups, the hub and its proxy.

- ``Student``s are real local accounts (``useradd -m``, a home only they may enter, a
  password set with ``chpasswd``, fresh each run), made idempotently and deleted with
  ``userdel -r`` at the end, so a rerun starts from nothing.
- ``cgroup_parents``: one folder per cgroup hierarchy (v1: under this process's own memory and
  cpu cgroups; v2: at the root, as tests/test_limits.py does), under which the hub's spawner
  makes each student's cgroup (tests/hub/jupyterhub_config.py).
- ``Hub``: configurable-http-proxy and ``jupyterhub`` (from this venv, as root, with the
  config above), each started by ``ddplab.procs`` in a session of its own on free ports of
  127.0.0.1, and ended by pid: ``stop_servers`` asks the hub to stop every student's server
  (its REST API, as an admin would), ``stop`` ends the hub, then the proxy, and with them
  anything still in those sessions or in the students' cgroups.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from ddplab import procs

CONFIG = Path(__file__).resolve().parent / "hub" / "jupyterhub_config.py"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROXY = "configurable-http-proxy"


@dataclass(frozen=True)
class Student:
    name: str
    uid: int
    gid: int
    home: Path
    password: str

    def processes(self) -> list[psutil.Process]:
        """Every live process of this account (a zombie has ended)."""
        found = []
        for p in psutil.process_iter(["uids", "status"]):
            if p.info["uids"] and p.info["uids"].real == self.uid and \
                    p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        return found


def make_student(name: str) -> Student:
    """The account ``name`` with a fresh password; made if missing, kept (but checked idle) if not."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True,
                       capture_output=True, text=True, timeout=60)
    user = pwd.getpwnam(name)
    running = [p for p in psutil.process_iter(["uids"])
               if p.info["uids"] and p.info["uids"].real == user.pw_uid]
    assert not running, (f"ddplab: the test account {name} already runs processes (from an earlier run "
                         f"cut short?): {[(p.pid, p.name()) for p in running]}. End them, then "
                         f"`userdel -r {name}`.")
    home = Path(user.pw_dir)
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, user.pw_uid, user.pw_gid)
    os.chmod(home, 0o700)                       # a class server's homes are private
    password = secrets.token_urlsafe(18)
    subprocess.run(["chpasswd"], input=f"{name}:{password}\n", check=True, capture_output=True,
                   text=True, timeout=60)
    return Student(name, user.pw_uid, user.pw_gid, home, password)


def remove_student(student: Student) -> None:
    subprocess.run(["userdel", "--remove", student.name], capture_output=True, text=True, timeout=60)
    shutil.rmtree(student.home, ignore_errors=True)


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (or v2's, for "")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" and controllers == ""):
            return path
    raise LookupError(controller)


def cgroup_parents() -> list[Path]:
    """Fresh folders, one per hierarchy, to hold the students' cgroups with a memory and a CPU
    limit; what is missing here (no cgroups, not root) fails with what to do."""
    name = f"ddplab-hub-{uuid.uuid4().hex[:8]}"
    v2 = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"
    listed = v2 / "cgroup.controllers"
    controllers = listed.read_text().split() if listed.exists() else []
    if "memory" in controllers and "cpu" in controllers:
        parent = v2 / name
        try:
            (v2 / "cgroup.subtree_control").write_text("+memory +cpu")
            parent.mkdir()
            (parent / "cgroup.subtree_control").write_text("+memory +cpu")
        except OSError as e:
            raise AssertionError(
                f"ddplab: the hub test limits each student with a cgroup v2 under {v2}, but cannot "
                f"delegate the memory and cpu controllers there ({e}); in a container, {v2} is the "
                f"container's own cgroup, which holds processes and so cannot have children with "
                f"controllers.") from e
        return [parent]
    parents = []
    for controller, limit in (("memory", "memory.limit_in_bytes"), ("cpu", "cpu.cfs_quota_us")):
        base = CGROUP_ROOT / controller
        assert (base / limit).exists(), (
            f"ddplab: the hub test limits each student with cgroups, but this machine has neither a "
            f"cgroup v2 with the memory and cpu controllers nor the v1 {controller} hierarchy at {base}")
        parent = base / _own_cgroup(controller).lstrip("/") / name
        parent.mkdir()
        parents.append(parent)
    return parents


def remove_cgroups(parents: list[Path]) -> list[str]:
    """Remove the parents and any student cgroup left in them; what could not be removed."""
    problems = []
    for parent in parents:
        for group in [*sorted(p for p in parent.iterdir() if p.is_dir()), parent] if parent.exists() else []:
            try:
                group.rmdir()
            except OSError as e:
                problems.append(f"{group}: {e} (holds {(group / 'cgroup.procs').read_text().split()})")
    return problems


def cgroup_pids(groups: list[Path]) -> set[int]:
    pids: set[int] = set()
    for group in groups:
        for procs_file in group.rglob("cgroup.procs") if group.exists() else []:
            pids |= {int(pid) for pid in procs_file.read_text().split()}
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hub:
    """configurable-http-proxy and JupyterHub, started on 127.0.0.1 and ended by pid."""

    def __init__(self, work: Path, env_prefix: Path, students: list[Student], cgroups: list[Path]):
        self.work, self.students, self.cgroups = work, students, cgroups
        self.port, self.api_token = free_port(), secrets.token_hex(32)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proxy_log, self.hub_log = work / "proxy.log", work / "jupyterhub.log"
        (work / "state").mkdir(mode=0o700)
        proxy_api, hub_api = free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
        self.env |= {"CONFIGPROXY_AUTH_TOKEN": secrets.token_hex(32), "DDPLAB_HUB_ENV": str(env_prefix),
                     "DDPLAB_HUB_STATE": str(work / "state"), "DDPLAB_HUB_PORT": str(self.port),
                     "DDPLAB_HUB_API_PORT": str(hub_api), "DDPLAB_HUB_PROXY_API_PORT": str(proxy_api),
                     "DDPLAB_HUB_USERS": " ".join(s.name for s in students),
                     "DDPLAB_HUB_CGROUPS": os.pathsep.join(map(str, cgroups)),
                     "DDPLAB_HUB_API_TOKEN": self.api_token}
        proxy = shutil.which(PROXY)
        assert proxy, f"ddplab: {PROXY} is not on PATH: `bash tools/ensure_hub.sh` installs it (as root)."
        self.proxy_command = [proxy, "--ip", "127.0.0.1", "--port", str(self.port),
                              "--api-ip", "127.0.0.1", "--api-port", str(proxy_api),
                              "--default-target", f"http://127.0.0.1:{hub_api}",
                              "--error-target", f"http://127.0.0.1:{hub_api}/hub/error"]
        self.hub_command = [str(Path(sys.executable).parent / "jupyterhub"), "-f", str(CONFIG)]
        self.proxy: subprocess.Popen | None = None
        self.hub: subprocess.Popen | None = None
        self.family = procs.Tree(sessions=True)

    def start(self, deadline_s: float = 120) -> None:
        with self.proxy_log.open("w") as out:
            self.proxy = procs.start(self.proxy_command, env=self.env, cwd=self.work, stdout=out,
                                     stderr=subprocess.STDOUT)
        self.family.add(self.proxy, session=True)
        with self.hub_log.open("w") as out:
            self.hub = procs.start(self.hub_command, env=self.env, cwd=self.work / "state", stdout=out,
                                   stderr=subprocess.STDOUT)
        self.family.add(self.hub, session=True)
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for what, proc in (("the proxy", self.proxy), ("the hub", self.hub)):
                assert proc.poll() is None, (f"ddplab: {what} exited with code {proc.returncode} at "
                                             f"start.\n{self.logs()}")
            try:
                if self.api("GET", "/hub/api/")["version"]:
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass                                   # not serving yet
            time.sleep(0.25)                           # polling a condition, with a deadline
        raise AssertionError(f"ddplab: the hub did not answer at {self.url}/hub/api/ within "
                             f"{deadline_s} s.\n{self.logs()}")

    def logs(self, chars: int = 4000) -> str:
        out = []
        for log in (self.hub_log, self.proxy_log):
            text = log.read_text(errors="replace") if log.exists() else "(none)"
            out.append(f"--- {log} (last {chars} characters)\n{text[-chars:]}")
        return "\n".join(out)

    def api(self, method: str, path: str) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.api_token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else {}

    def servers(self) -> dict[str, dict]:
        """Each student's default server as the hub sees it (absent: no server)."""
        return {u["name"]: u["servers"][""] for u in self.api("GET", "/hub/api/users")
                if u.get("servers", {}).get("")}

    def note(self) -> None:
        """Remember every process the hub started so far, even one that left its tree."""
        self.family.note()
        for pid in cgroup_pids(self.cgroups):
            self.family.add(pid)

    def stop_servers(self, deadline_s: float = 120) -> None:
        """Ask the hub to stop every student's server, as an admin would; wait until the hub says
        they are stopped and no process of any student is left."""
        self.note()

        def stop(student: Student) -> None:
            try:
                self.api("DELETE", f"/hub/api/users/{student.name}/server")
            except urllib.error.HTTPError as e:
                if e.code != 400:                      # 400: that server was not running
                    raise

        # All at once, as an admin's "stop all": the hub answers each request only once that
        # server has stopped (or after 10 s), so one after the other would add up.
        with ThreadPoolExecutor(len(self.students) or 1) as pool:
            list(pool.map(stop, self.students))
        deadline = time.monotonic() + deadline_s
        left: dict = {}
        while time.monotonic() < deadline:
            left = {"servers": self.servers(),
                    "processes": {s.name: [(p.pid, p.name()) for p in s.processes()] for s in self.students
                                  if s.processes()}}
            if not left["servers"] and not left["processes"]:
                return
            time.sleep(0.25)                           # polling a condition, with a deadline
        raise AssertionError(f"ddplab: {deadline_s} s after the hub was asked to stop the students' "
                             f"servers, still there: {left}\n{self.logs()}")

    def stop(self) -> list[psutil.Process]:
        """End the hub (SIGTERM, as an admin's Ctrl-C), then the proxy, by pid; then whatever is
        left of what they started. Returns what survived even SIGKILL (normally nothing)."""
        if self.hub is None:
            return []
        self.note()
        procs.send(self.hub, signal.SIGTERM)
        try:
            self.hub.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass                                       # the policy below ends it
        procs.send(self.proxy, signal.SIGTERM)
        try:
            self.proxy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        survivors = self.family.end(grace=10)
        self.hub.wait()
        self.proxy.wait()
        return survivors
