"""A JupyterHub for a class on one server, as tests/test_hub.py runs it (an admin may copy it).

- Login: PAM (``PAMAuthenticator``), the machine's own accounts and passwords; only the
  students named may log in.
- One server per student: ``LocalProcessSpawner`` starts ``jupyterhub-singleuser`` as the
  student, from the environment every student shares (ddplab and jupyterhub, pinned by
  constraints.txt, readable by all), on the student workspace ``~/ddplab``, made on each
  start by ``ddplab notebooks`` as the student (it never overwrites their work).
- Limits: ``CgroupSpawner`` puts each server into a cgroup of the student's own, with
  ``mem_limit`` and ``cpu_limit``, before it becomes the student: everything the server starts
  (kernels, ddplab's ranks) is inside, the kernel enforces the limits on all of it together,
  and ``ddplab.start()`` reads them (``ddplab.limits``). When the server has stopped, the
  cgroup must be empty; what is still in it is reported, killed, and the cgroup removed.
- Kernels on Unix sockets (``--KernelManager.transport=ipc``), not on TCP ports of 127.0.0.1.
- The proxy (configurable-http-proxy) is started apart (``should_start = False``), by the
  test, on 127.0.0.1, like everything else here.

The values an admin would write in are read from ``DDPLAB_HUB_*`` variables, which the test sets.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
import time
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Float, List, Unicode

from ddplab import procs

c = get_config()  # noqa: F821  (JupyterHub's config loader defines it)

ENV = Path(os.environ["DDPLAB_HUB_ENV"])             # the students' environment (a venv)
STATE = Path(os.environ["DDPLAB_HUB_STATE"])          # the hub's database and secret
WORKSPACE = "ddplab"                                  # ~/ddplab: the student workspace


class CgroupSpawner(LocalProcessSpawner):
    """``LocalProcessSpawner`` with a cgroup per student holding ``mem_limit`` and ``cpu_limit``."""

    cgroup_parents = List(Unicode(), help="""Folders under which each student's cgroup is made,
        one per hierarchy: a cgroup v2 folder (memory.max and cpu.max), or the v1 memory and cpu
        hierarchies' folders (memory.limit_in_bytes, cpu.cfs_quota_us).""").tag(config=True)
    cgroup_grace = Float(30.0, help="""Seconds the processes left in a student's cgroup, once the
        server has exited, get to end on their own (a kernel ends its lab) before they are
        killed.""").tag(config=True)

    def cgroups(self) -> list[Path]:
        return [Path(parent) / self.user.name for parent in self.cgroup_parents]

    def make_cgroups(self) -> list[Path]:
        """Make the student's cgroups (idempotent) and write the limits into them."""
        made, limited = self.cgroups(), []
        for group in made:
            group.mkdir(exist_ok=True)
            limits = {"memory.max": self.mem_limit, "memory.limit_in_bytes": self.mem_limit}
            if self.cpu_limit:
                period = 100_000
                limits |= {"cpu.max": f"{int(self.cpu_limit * period)} {period}",
                           "cpu.cfs_period_us": period, "cpu.cfs_quota_us": int(self.cpu_limit * period)}
            for name, value in limits.items():
                if value and (group / name).exists():
                    (group / name).write_text(str(value))
                    limited.append(f"{group / name}={value}")
        if not limited:
            raise RuntimeError(f"ddplab hub: no memory or cpu limit file in {made}: c.CgroupSpawner."
                               f"cgroup_parents must name cgroup folders with those controllers")
        self.log.info("ddplab hub: %s's limits: %s", self.user.name, ", ".join(limited))
        return made

    def make_preexec_fn(self, name):
        become_user = super().make_preexec_fn(name)
        joins = [str(group / "cgroup.procs") for group in self.make_cgroups()]

        def preexec():
            # In the child, still root: join the cgroups, then become the student and exec.
            for path in joins:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)
            become_user()

        return preexec

    def left_in_cgroups(self) -> set[int]:
        pids: set[int] = set()
        for group in self.cgroups():
            if (group / "cgroup.procs").exists():
                pids |= {int(pid) for pid in (group / "cgroup.procs").read_text().split()}
        return pids

    async def stop(self, now=False):
        await super().stop(now=now)
        deadline = time.monotonic() + self.cgroup_grace
        while self.left_in_cgroups() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        left = self.left_in_cgroups()
        if left:
            described = []
            for pid in sorted(left):
                process = procs.process(pid)
                described.append(f"{pid} {' '.join(process.cmdline())[:120] if process else '?'}")
            self.log.warning("ddplab hub: %s's server has exited, but its cgroup still holds %d "
                             "processes after %.0f s; killing them: %s", self.user.name, len(left),
                             self.cgroup_grace, "; ".join(described))
            for pid in left:
                procs.send(pid, signal.SIGKILL)
            while self.left_in_cgroups() and time.monotonic() < deadline + 10:
                await asyncio.sleep(0.2)
        for group in self.cgroups():
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                self.log.warning("ddplab hub: cannot remove %s: %s", group, e)


async def make_workspace(spawner) -> None:
    """``ddplab notebooks ~/ddplab`` as the student: the student versions of the notebooks,
    the new ones added, none already there overwritten."""
    user = pwd.getpwnam(spawner.user.name)
    made = await asyncio.create_subprocess_exec(
        str(ENV / "bin" / "ddplab"), "notebooks", os.path.join(user.pw_dir, WORKSPACE),
        user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd=user.pw_dir,
        env={"HOME": user.pw_dir, "PATH": f"{ENV / 'bin'}:/usr/bin:/bin", "LANG": "C.UTF-8"},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    out, _ = await made.communicate()
    if made.returncode:
        raise RuntimeError(f"ddplab notebooks failed for {spawner.user.name} "
                           f"(exit {made.returncode}): {out.decode()[-2000:]}")


# The hub and its proxy, on 127.0.0.1 only.
c.JupyterHub.bind_url = f"http://127.0.0.1:{os.environ['DDPLAB_HUB_PORT']}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ["DDPLAB_HUB_API_PORT"])
c.ConfigurableHTTPProxy.should_start = False          # the test starts it, and ends it by its pid
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ['DDPLAB_HUB_PROXY_API_PORT']}"
# (its token: CONFIGPROXY_AUTH_TOKEN, in the environment of both)
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.cleanup_servers = True                   # a hub that stops stops its servers

# Login: the machine's accounts, through PAM; only the class.
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allowed_users = set(os.environ["DDPLAB_HUB_USERS"].split())

# The students' servers.
c.JupyterHub.spawner_class = CgroupSpawner
c.CgroupSpawner.cgroup_parents = os.environ["DDPLAB_HUB_CGROUPS"].split(os.pathsep)
c.Spawner.mem_limit = os.environ.get("DDPLAB_HUB_MEM_LIMIT", "1536M")
c.Spawner.cpu_limit = float(os.environ.get("DDPLAB_HUB_CPU_LIMIT", "1"))
c.Spawner.cmd = [str(ENV / "bin" / "jupyterhub-singleuser")]
c.Spawner.environment = {"PATH": f"{ENV / 'bin'}:/usr/local/bin:/usr/bin:/bin"}
c.Spawner.pre_spawn_hook = make_workspace
c.Spawner.notebook_dir = f"~/{WORKSPACE}"
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 180                         # three servers starting at once on 2 cores
c.Spawner.http_timeout = 180
c.Spawner.args = [# Kernels on Unix sockets in the student's own runtime folder. On Jupyter's default, TCP
                  # ports of 127.0.0.1, any local user may subscribe to a kernel's iopub channel and
                  # read every output of the student's cells (signing only stops forged messages).
                  "--KernelManager.transport=ipc",
                  "--LabApp.news_url=None",
                  "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                  # the test reads the notebook's model in the page, as JupyterLab's own UI tests do
                  "--LabApp.expose_app_in_browser=True"]

# The test's own access: list the students, stop their servers.
c.JupyterHub.services = [{"name": "ddplab-test", "api_token": os.environ["DDPLAB_HUB_API_TOKEN"]}]
c.JupyterHub.load_roles = [{"name": "ddplab-test", "scopes": ["admin:users", "admin:servers"],
                            "services": ["ddplab-test"]}]
