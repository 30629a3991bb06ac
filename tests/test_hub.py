"""A class on one server, for real: three students on a JupyterHub, each running notebook 00 at once.

What a class server promises (docs/class-server.md), tried end to end
with the real programs: ``jupyterhub`` from PyPI (this venv, as root) behind
``configurable-http-proxy`` from npm, both on 127.0.0.1, with the configuration an admin
would write (tests/hub/jupyterhub_config.py). Three local accounts (hubkit) log in through
the hub's login page in Debian's Chromium (PAM checks their passwords), each gets a server
of their own, as themselves, in a cgroup of their own with a 1.5 GiB memory limit and one
CPU, from a shared environment every user may read (shared_env), on the student workspace.

Then, at the same time, each runs all of notebook 00 from the menus, as in
tests/test_browser_notebooks.py, and each page must show every cell run without an error and with the
committed output. One more cell per student starts a lab that stays up, and reports what
ddplab sees from inside: the cgroup's limits (the same in the kernel and on the ranks), a
private network for the ranks, an owner-only lab directory. While the three labs run, every
socket of each lab is tried from the other two students' accounts (labprobe, as
tests/test_isolation.py does with ``nobody``): none may accept, and none may enter the ranks'
network, while the same attempt reaches a port left open on purpose. Beyond the labs, no Unix
socket of any process of a student (their kernel's channels, on ipc) accepts the others, none
listens on TCP but the server's HTTP port and ipykernel's keyed output pipe, and the hub answers
403 when one student opens another's lab.

At the end the hub stops the servers (its REST API), the test ends the hub and the proxy by
pid, and nothing may be left: no process of the students, nothing in their cgroups (the
spawner would say so in the hub's log), no hub or proxy, no lab directory in /tmp. The
accounts are deleted, so a rerun starts from nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path

import nbformat
import psutil
import pytest
import shared_env
from browserkit import (
    CELLS_JS,
    CHROMIUM_FLAGS,
    KERNEL_IDLE_JS,
    ROOT,
    answer_every_exercise,
    browser_required,
    check_page,
    first_line,
    not_finished,
    require_chromium,
    run_finished,
    save_screenshots,
    start_run_all,
)
from hubkit import PROXY, Hub, cgroup_parents, make_student, remove_cgroups, remove_student
from labprobe import connect_as, in_use_here, lab_sockets, listening_here

from ddplab import procs

pytestmark = [pytest.mark.hub,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it makes local accounts, cgroups "
                                 "and runs JupyterHub as root, as on a class server (CI runs it as root)")]

NAMES = ("ddplab-ada", "ddplab-bo", "ddplab-cy")
NOTEBOOK = "00_setup.ipynb"
MEM_LIMIT = 1536 * 2**20          # what the spawner sets: DDPLAB_HUB_MEM_LIMIT's default, 1536M
CPU_LIMIT = 1
LOGIN_DEADLINE = 300              # three servers starting at once on 2 cores
OPEN_DEADLINE = 180
RUN_DEADLINE = 600
EXTRA_DEADLINE = 180

# The cell each student runs after the notebook: a lab that stays up, and what ddplab sees.
EXTRA_CELL = '''
import json, ddplab
from ddplab import limits

def _sum_of_ones():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t)

def _limit_on_the_rank():
    from ddplab import limits
    return limits.memory().limit

lab = ddplab.start(world_size=2, init_method="env")
room = limits.memory()
print("DDPLAB-HUB " + json.dumps({
    "total": lab.run(_sum_of_ones), "rank_limits": lab.run(_limit_on_the_rank),
    "limit": room.limit, "source": room.source, "available": room.available, "cpus": limits.cpus(),
    "describe": lab.describe(), "directory": lab.directory,
    "controller": lab.controller_pid, "engines": lab.engines.pids}))
'''

# Runs code in the notebook's kernel, as one more cell would; the result lands in window.ddplabExtra.
EXECUTE_JS = """([name, code]) => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  window.ddplabExtra = null;
  const out = [];
  const future = panel.sessionContext.session.kernel.requestExecute({code, stop_on_error: true});
  future.onIOPub = msg => {
    if (msg.header.msg_type === 'stream') out.push(msg.content.text);
    if (msg.header.msg_type === 'error') out.push(`${msg.content.ename}: ${msg.content.evalue}`);
  };
  future.done.then(reply => { window.ddplabExtra = {status: reply.content.status, out: out.join('')}; },
                   error => { window.ddplabExtra = {status: 'failed', out: out.join('') + String(error)}; });
}"""


@pytest.fixture(scope="module")
def needs():
    """What the test cannot do without, checked before anything is built or made: Chromium and
    the proxy. Missing, they skip the test by hand and fail it under make test (and CI)."""
    require_chromium()
    if not shutil.which(PROXY):
        problem = f"ddplab: the hub test needs JupyterHub's proxy, {PROXY}, but it is not on PATH."
        advice = "`bash tools/ensure_hub.sh` installs it with npm, as root (make test runs it)."
        if browser_required():
            pytest.fail(f"{problem} {advice} See its message above this run.", pytrace=False)
        pytest.skip(f"{problem} {advice}")


@pytest.fixture(scope="module")
def students_env(needs):
    """The environment every student's server runs (built once, then reused: shared_env)."""
    return shared_env.ensure()


@pytest.fixture(scope="module")
def students(needs):
    """The three accounts, for this run alone: a second run on this machine waits for the lock."""
    made = []
    shared_env.HOME.mkdir(mode=0o755, exist_ok=True)         # root's, 0755: see shared_env.ensure
    with open(shared_env.HOME / ".accounts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for name in NAMES:
                made.append(make_student(name))
            yield made
        finally:
            for student in made:
                remove_student(student)


@pytest.fixture
def hub(tmp_path, students, students_env):
    """The hub and its proxy, running; ended by pid at the end whatever happened."""
    cgroups = cgroup_parents()
    running = Hub(tmp_path, students_env.prefix, students, cgroups)
    try:
        running.start()
        yield running
    finally:
        running.stop()
        remove_cgroups(cgroups)


def committed_stdout(name: str) -> list[str | None]:
    """Per cell, what the committed notebook printed (None where its output is not compared)."""
    out = []
    for cell in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells:
        ignored = (cell.source.startswith("# NBVAL_IGNORE_OUTPUT")
                   or "nbval-ignore-output" in cell.metadata.get("tags", []))
        out.append(None if ignored or cell.cell_type != "code" else "".join(
            o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"))
    return out


def same_output_as_committed(student: str, cells: list[dict]) -> None:
    expected = committed_stdout(NOTEBOOK)
    for cell in cells:
        want = expected[cell["index"]]
        if want is not None:
            assert cell["stdout"].strip() == want.strip(), (
                f"{student}: {first_line(cell)} printed\n{cell['stdout']!r}\n"
                f"but the committed notebook\n{want!r}")


def wait_for_all(pages: dict, done, what: str, deadline_s: float, describe) -> None:
    """Poll ``done(page)`` on every page until all are done; else fail with ``describe`` of the rest."""
    deadline = time.monotonic() + deadline_s
    waiting = dict(pages)
    while waiting and time.monotonic() < deadline:
        waiting = {name: page for name, page in waiting.items() if not done(page)}
        if waiting:
            next(iter(waiting.values())).wait_for_timeout(500)   # polling conditions, with a deadline
    if waiting:
        raise AssertionError(f"ddplab: {what} did not finish within {deadline_s} s for "
                             f"{sorted(waiting)}: " + "; ".join(describe(n, p) for n, p in waiting.items()))


@pytest.mark.timeout(LOGIN_DEADLINE + 2 * OPEN_DEADLINE + RUN_DEADLINE + EXTRA_DEADLINE + 900)
def test_three_students_log_in_and_run_notebook_00_at_once(chromium, hub, students, students_env,
                                                           tmp_path, record_property, capsys):
    from playwright.sync_api import sync_playwright

    times: dict[str, float] = {}
    clock = [time.monotonic()]

    def lap(what: str) -> None:
        times[what], clock[0] = time.monotonic() - clock[0], time.monotonic()

    by_name = {s.name: s for s in students}
    seen: dict[str, dict] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, headless=True)
        pages = {}
        try:
            for student in students:                   # all three log in, then all wait
                page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
                page.set_default_timeout(LOGIN_DEADLINE * 1000)
                page.goto(f"{hub.url}/hub/login")
                page.fill("#username_input", student.name)
                page.fill("#password_input", student.password)
                page.click("#login_submit", no_wait_after=True)
                pages[student.name] = page
            for name, page in pages.items():
                page.wait_for_url(re.compile(rf"/user/{name}/lab"), timeout=LOGIN_DEADLINE * 1000)
            lap("start Chromium, log in, spawn")
            servers = hub.servers()
            assert sorted(servers) == sorted(NAMES) and all(s["ready"] for s in servers.values()), servers

            for name, page in pages.items():     # each answered the exercise, as one who solved it
                answer_every_exercise(by_name[name].home / "ddplab" / NOTEBOOK)
                page.goto(f"{hub.url}/user/{name}/lab/tree/{NOTEBOOK}")
            for page in pages.values():
                page.wait_for_function(KERNEL_IDLE_JS, arg=NOTEBOOK, timeout=OPEN_DEADLINE * 1000)
            lap("open the notebook")
            for page in pages.values():
                start_run_all(page, NOTEBOOK)
            wait_for_all(pages, run_finished, "Run All Cells", RUN_DEADLINE,
                         lambda name, page: f"{name}: {not_finished(page, NOTEBOOK, RUN_DEADLINE)}")
            lap("run notebook 00, three at once")
            for name, page in pages.items():
                cells = page.evaluate(CELLS_JS, NOTEBOOK)
                check_page(page, cells, NOTEBOOK)
                same_output_as_committed(name, cells)

            for page in pages.values():
                page.evaluate(EXECUTE_JS, [NOTEBOOK, EXTRA_CELL])
            wait_for_all(pages, lambda page: page.evaluate("window.ddplabExtra") is not None,
                         "the extra cell", EXTRA_DEADLINE, lambda name, page: name)
            for name, page in pages.items():
                result = page.evaluate("window.ddplabExtra")
                assert result["status"] == "ok" and "DDPLAB-HUB " in result["out"], f"{name}: {result}"
                seen[name] = json.loads(result["out"].split("DDPLAB-HUB ", 1)[1])
            check_limits_and_labs(seen, hub, students)
            lap("check the pages, start a lab each")
            check_isolation(seen, students, students_env)
            check_nothing_else_is_reachable(students, students_env, pages, hub)
            lap("try each lab from the others")
        except BaseException:
            for name, page in pages.items():
                save_screenshots(page, tmp_path, record_property, capsys, failing=True, name=name)
            raise
        finally:
            browser.close()

    # The hub stops the servers; every process of the students ends, ddplab's labs included.
    hub.stop_servers()
    lap("stop the servers")
    log = hub.hub_log.read_text()
    assert "still holds" not in log, (f"the spawner had to kill processes left in a student's "
                                      f"cgroup:\n{log[-4000:]}")
    left_groups = [group for parent in hub.cgroups for group in parent.iterdir() if group.is_dir()]
    assert not left_groups, f"the spawner did not remove the students' cgroups: {left_groups}"
    survivors = hub.stop()
    assert not survivors, f"processes of the hub survived SIGKILL: {survivors}"
    assert hub.hub.returncode is not None and hub.proxy.returncode is not None
    lap("end the hub and the proxy")
    for student in students:
        assert not student.processes(), f"{student.name} still runs {student.processes()}"
        mine = [p for p in Path("/tmp").glob("ddplab-*") if p.lstat().st_uid == student.uid]
        assert not mine, f"{student.name}'s labs left their directories: {mine}"
    built = ", ".join(f"{step} {wall:.0f} s ({used:.0f} s CPU)"
                      for step, (wall, used) in students_env.steps.items())
    with capsys.disabled():
        print(f"\n[test_hub] students' environment {students_env.what} ({students_env.prefix})"
              + (f": {built}" if built else "") + "; "
              + ", ".join(f"{what} {seconds:.0f} s" for what, seconds in times.items()))
        for name, got in seen.items():
            print(f"[test_hub] {name}: ddplab sees the cgroup limit of {got['limit'] >> 20} MB "
                  f"({got['available'] >> 20} MB of it free with a lab running) and {got['cpus']} CPU, "
                  f"in the kernel and on both ranks")


def check_limits_and_labs(seen: dict[str, dict], hub: Hub, students) -> None:
    """Each student's own lab, in their own cgroup, whose limits ddplab sees from inside."""
    directories = set()
    for student in students:
        got = seen[student.name]
        assert got["total"] == [2, 2], got
        assert got["limit"] == MEM_LIMIT and got["rank_limits"] == [MEM_LIMIT, MEM_LIMIT], got
        assert got["source"] == f"the cgroup limit of {MEM_LIMIT >> 20} MB", got
        assert got["cpus"] == CPU_LIMIT, got
        assert "share this machine's network" not in got["describe"], got["describe"]
        info = os.stat(got["directory"])
        assert info.st_uid == student.uid and stat.S_IMODE(info.st_mode) == 0o700, (got["directory"], info)
        directories.add(got["directory"])
        # every process of the student (server, kernel, controller, template, ranks) is in its cgroup
        theirs = {p.pid for p in student.processes()}
        for parent in hub.cgroups:
            inside_here = {int(pid) for pid in (parent / student.name / "cgroup.procs").read_text().split()}
            outside = {pid for pid in theirs - inside_here if procs.alive(pid)}   # not one that just ended
            assert not outside, f"{student.name}: processes outside {parent / student.name}: {sorted(outside)}"
        assert {got["controller"], *got["engines"]} <= theirs, (student.name, got, theirs)
    assert len(directories) == len(students), directories


def check_nothing_else_is_reachable(students, env, pages: dict, hub: Hub) -> None:
    """Beyond the labs, every process of a student: its Unix sockets refuse the other students
    (the kernels' channels among them, on ipc), and on TCP it listens only where it must: the
    server's HTTP port (the proxy reaches it there; the hub turns the other students away) and
    in each kernel the one port ipykernel always opens on 127.0.0.1, its pipe for output from
    forked processes (a PULL socket that drops any message without the kernel's random key)."""
    for owner in students:
        server = [p for p in owner.processes() if "jupyterhub-singleuser" in " ".join(p.cmdline())]
        kernels = [p for p in owner.processes() if "ipykernel_launcher" in p.cmdline()]
        assert len(server) == 1 and len(kernels) == 1, (owner.name, server, kernels)
        pids = {p.pid for p in owner.processes()}
        ports, paths = listening_here(pids)
        http, _ = listening_here({server[0].pid})
        pipe, _ = listening_here({kernels[0].pid})
        if not (len(http) == 1 and len(pipe) <= 1 and set(ports) == set(http) | set(pipe)):
            who = {c.laddr.port: " ".join(procs.process(c.pid).cmdline())[:200]
                   for c in psutil.net_connections("inet") if c.pid in pids and c.status == psutil.CONN_LISTEN}
            raise AssertionError(f"{owner.name}'s processes listen on TCP ports {ports} of this machine; "
                                 f"expected only the server's HTTP port {http} and the kernel's output "
                                 f"pipe (its channels on ipc): {who}")
        assert any("-ipc-" in path for path in paths), f"{owner.name}'s kernel is not on ipc: {paths}"
        for other in students:
            if other is not owner:
                reached = connect_as(other.uid, other.gid, str(env.python), [], paths)
                assert reached == [], f"{other.name} reached {owner.name}'s sockets: {reached}"
                answer = pages[other.name].request.get(f"{hub.url}/user/{owner.name}/lab",
                                                       max_redirects=10)
                assert answer.status == 403, (f"{other.name} opened {owner.name}'s lab: "
                                              f"HTTP {answer.status}, {answer.text()[:300]!r}")


def check_isolation(seen: dict[str, dict], students, env) -> None:
    """No socket of one student's lab accepts another student, nor may they enter its ranks' network."""
    with socket.socket() as control:
        control.bind(("127.0.0.1", 0))
        control.listen()
        port = control.getsockname()[1]
        for student in students:                    # the attempt itself works, from every account
            assert connect_as(student.uid, student.gid, str(env.python), [port], []) == [f"tcp {port}"]
    elsewhere = in_use_here()
    for owner in students:
        lab = seen[owner.name]
        ports, paths = lab_sockets(lab["controller"], lab["engines"])
        assert ports and len(paths) >= 10, (owner.name, ports, paths)
        ports = [p for p in ports if p not in elsewhere]
        assert ports, f"{owner.name}: every port of the ranks is also in use on this machine's network"
        namespaces = [f"/proc/{pid}/ns/net" for pid in lab["engines"]]
        for other in students:
            if other is not owner:
                reached = connect_as(other.uid, other.gid, str(env.python), ports, paths, namespaces)
                assert reached == [], f"{other.name} reached {owner.name}'s lab: {reached}"
