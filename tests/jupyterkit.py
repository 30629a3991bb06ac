"""A Jupyter server for the browser tests: its environment, its start, its REST API, its end.

tests/test_browser_notebooks.py (one server for the module) and
tests/test_browser_make_lab.py (JupyterLab as ``make lab`` starts it) start JupyterLab from
the venv on 127.0.0.1 with a random token; every Jupyter setting and state folder is in the
test's temporary folder. What they do in the page is browserkit's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from leakcheck import my_process_tree

from ddplab import procs

JUPYTER = Path(sys.executable).parent / "jupyter"


# Notebook 7's walk: notebook 00, the one every learner runs first (issue 44).
NOTEBOOK7 = "00_setup.ipynb"
# Where each front end opens a notebook, after the server's URL.
PAGES = {"jupyterlab": "lab/tree", "notebook7": "notebooks"}
# Generous: several labs share 2 cores, and 01 waits out a HangError's timeout on purpose.
SERVER_DEADLINE = 120
OPEN_DEADLINE = 180
RUN_DEADLINE = 900


def lab_env(home: Path) -> dict[str, str]:
    """The environment for the server: every Jupyter setting and state dir in tmp, so a user's
    own settings, workspaces and extensions cannot change what the test sees."""
    dirs = {"HOME": "home", "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
            "JUPYTER_RUNTIME_DIR": "runtime", "IPYTHONDIR": "ipython",
            "JUPYTERLAB_SETTINGS_DIR": "lab-settings", "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces"}
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_PATH", "JUPYTER_TOKEN")}
    for name, sub in dirs.items():
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(home / sub)
    # JupyterLab 4 asks in a pop-up whether to fetch news from the internet; answer "never".
    notification = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    return env


def wait_for_server(proc: subprocess.Popen, runtime: Path, token: str, log: Path) -> str:
    """The server's base URL, once its /api/status answers. Jupyter may move to another port
    when ours was taken meanwhile, so the port comes from the file it writes on start."""
    deadline = time.monotonic() + SERVER_DEADLINE
    info_file = runtime / f"jpserver-{proc.pid}.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ddplab: JupyterLab exited with code {proc.returncode} before it "
                                 f"answered. Its log:\n{log.read_text()[-3000:]}")
        if info_file.exists():
            try:
                url = f"http://127.0.0.1:{json.loads(info_file.read_text())['port']}"
                request = urllib.request.Request(f"{url}/api/status",
                                                 headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(request, timeout=10) as response:
                    if response.status == 200:
                        return url
            except (OSError, ValueError, KeyError, urllib.error.URLError):
                pass                                   # written but not serving yet
        time.sleep(0.25)                               # polling a condition, with a deadline
    raise AssertionError(f"ddplab: JupyterLab did not answer /api/status within {SERVER_DEADLINE} s. "
                         f"Its log:\n{log.read_text()[-3000:]}")


def end_processes(proc: subprocess.Popen, started: set[int]) -> None:
    """End the server, the kernel it started and the kernel's ranks. Only processes this test
    started: the server's session and tree, and what appeared in this process's tree since
    ``started``.

    First the server alone gets SIGTERM, as from Ctrl-C in its terminal: jupyter shuts its
    kernels down, and each kernel's exit stops its lab. Then whatever is left gets ddplab.procs'
    policy (SIGTERM, then SIGKILL). Signalling everything at once would end a lab's controller
    beside its kernel, so neither would remove the lab's directory.
    """
    family = procs.Tree([proc], sessions=True)
    family.note()
    for pid in my_process_tree() - started:
        family.add(pid)
    procs.send(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass                                        # the policy below ends it
    alive = family.end(grace=30)
    proc.wait()
    assert not alive, f"ddplab: processes the browser test started survived a kill: {alive}"


@dataclass(frozen=True)
class Server:
    """A running Jupyter server: where it answers, its token and the folder it serves."""
    url: str
    token: str
    workspace: Path


def api(server: Server, path: str, method: str = "GET"):
    """One call to the server's REST API (``path`` after the base URL); its JSON answer, if any."""
    request = urllib.request.Request(f"{server.url}/{path}", method=method,
                                     headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = response.read()
    return json.loads(body) if body else None
