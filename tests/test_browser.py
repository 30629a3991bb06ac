"""A notebook run the way a student runs it: JupyterLab in a real browser.

Every other test talks to ddplab from Python; this one drives the product
where it is used. It starts JupyterLab from the venv (the server ``make lab``
runs, on 127.0.0.1 with a token), opens a notebook in Debian's headless
Chromium through Playwright, clicks Run > Run All Cells, waits for the kernel
to answer every cell, and then checks the page itself:

- per-rank output is rendered in rank order (``[rank 0]`` before ``[rank 1]``,
  and grid rows of ``ddplab.show`` top to bottom), the same labels as the
  committed notebook;
- every ipywidget view rendered, none shows "Error displaying widget";
- no cell shows an error, except a cell tagged ``raises-exception`` (the
  deadlock demo), which must show the error the committed notebook shows.

It saves screenshots under the test's tmp_path and prints their paths.

The browser is Debian's ``chromium`` at /usr/bin/chromium, never one that
Playwright downloads. ``make test`` installs it when missing
(tools/ensure_chromium.sh) and sets DDPLAB_REQUIRE_BROWSER=1, so there (and
wherever CI is set) a missing browser fails the test. Run by hand without
Chromium, the test skips and says why.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import lab_dirs, my_process_tree

from ddplab import procs

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
JUPYTER = Path(sys.executable).parent / "jupyter"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The newest notebook that exercises the most: 01 has a deadlock demo, 00 is the fallback.
NOTEBOOK = next(name for name in ("01_point_to_point.ipynb", "00_setup.ipynb")
                if (ROOT / "notebooks" / name).exists())
# Generous: several labs share 2 cores, and 01 waits out a HangError's timeout on purpose.
SERVER_DEADLINE = 120
OPEN_DEADLINE = 180
RUN_DEADLINE = 900
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def browser_required() -> bool:
    """Under `make test` (and CI) a missing browser is a failure, never a skip."""
    return (os.environ.get("DDPLAB_REQUIRE_BROWSER") == "1"
            or os.environ.get("CI", "").lower() in ("1", "true", "yes"))


@pytest.fixture
def chromium() -> str:
    """The path of Debian's Chromium; skip (by hand) or fail (make test, CI) without it."""
    if os.access(CHROMIUM, os.X_OK):
        return str(CHROMIUM)
    problem = f"ddplab: the browser test needs Debian's Chromium at {CHROMIUM}, but it is not installed."
    if browser_required():
        pytest.fail(f"{problem} make test installs it with tools/ensure_chromium.sh (apt-get, as "
                    f"root), which could not: see its message above this run. Install it with "
                    f"`apt-get update && apt-get install -y chromium`.", pytrace=False)
    pytest.skip(f"{problem} Install it (`apt-get install chromium`) to run this test; make test "
                f"does so and then requires it.")


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


def answer_every_exercise(path: Path) -> None:
    """Put the reference's exercise cells into the student version at path."""
    reference = {c.get("id"): c for c in nbformat.read(ROOT / "notebooks" / path.name, as_version=4).cells}
    student = nbformat.read(path, as_version=4)
    for cell in student.cells:
        if cell.get("id", "").startswith("exercise-"):
            assert "NotImplementedError" in cell.source, "the workspace holds the reference"
            cell.source = reference[cell.id].source
    nbformat.write(student, path)


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server on a student workspace, made as `make lab` makes it (ddplab notebooks),
    with every exercise answered as a student who solved it would: the reference solution in
    place of the stub. Yields (base URL, token). Always shut down, with its kernels, even when
    the test fails.
    """
    notebooks = tmp_path / "workspace"
    subprocess.run([sys.executable, "-m", "ddplab", "notebooks", str(notebooks)], check=True,
                   capture_output=True, timeout=120)
    answer_every_exercise(notebooks / NOTEBOOK)
    env = lab_env(tmp_path / "jupyter")
    token = secrets.token_hex(24)
    log = tmp_path / "jupyterlab.log"
    command = [str(JUPYTER), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               "--ServerApp.port=0", f"--IdentityProvider.token={token}",
               f"--notebook-dir={notebooks}",
               "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               # Lets the test read the notebook model (cell tags, outputs, kernel messages)
               # in the page, as JupyterLab's own UI tests (Galata) do.
               "--LabApp.expose_app_in_browser=True"]
    if os.getuid() == 0:
        command.append("--allow-root")
    started, dirs_before = my_process_tree(), lab_dirs()
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield wait_for_server(proc, Path(env["JUPYTER_RUNTIME_DIR"]), token, log), token
    finally:
        end_processes(proc, started)
    left = lab_dirs() - dirs_before
    assert not left, f"the kernel's lab left its directory behind: {sorted(left)}"


# In the page: each cell of the open notebook, from JupyterLab's model and from what is drawn.
CELLS_JS = """name => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  return panel.content.widgets.map((cell, index) => {
    const m = cell.model;
    const area = cell.node.querySelector('.jp-Cell-outputArea');
    const children = area ? Array.from(area.children).filter(n => n.classList.contains('jp-OutputArea-child')) : [];
    const rendered = mime => Array.from(cell.node.querySelectorAll(
        `.jp-OutputArea-output[data-mime-type="${mime}"]`));
    return {
      index, type: m.type, source: m.sharedModel.getSource(), tags: m.getMetadata('tags') || [],
      count: m.type === 'code' ? m.executionCount : null,
      errors: m.type === 'code' ? m.outputs.toJSON().filter(o => o.output_type === 'error')
                                  .map(o => ({ename: o.ename, evalue: o.evalue})) : [],
      stdout: rendered('application/vnd.jupyter.stdout').map(n => n.textContent).join(''),
      stderr: rendered('application/vnd.jupyter.stderr').map(n => n.textContent).join(''),
      grids: Array.from(cell.node.querySelectorAll('.jp-OutputArea-output table')).map(t =>
          Array.from(t.querySelectorAll('tr > th:first-child')).map(th => th.textContent)
               .filter(s => /^rank \\d+$/.test(s))),
      // A widget view is drawn inside a panel without a mime type: find it by output index.
      widgets: (m.type === 'code' ? m.outputs.toJSON() : []).map((o, i) => [o, children[i]])
          .filter(([o]) => o.data && o.data['""" + WIDGET_MIME + """'])
          .map(([o, child]) => {
            const n = child && child.querySelector('.jp-OutputArea-output');
            return {text: n ? n.textContent : '(nothing drawn)',
                    drawn: !!n && n.querySelector('.jupyter-widgets, [class*="widget-"]') !== null};
          }),
    };
  });
}"""

# Counts execute requests sent and replies received, to know when Run All is finished:
# prompts alone cannot say, since JupyterLab blanks queued prompts after a cell's error.
WATCH_KERNEL_JS = """name => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  window.ddplabRun = {sent: 0, replies: 0, idle: 0};
  panel.sessionContext.session.kernel.anyMessage.connect((_, {msg, direction}) => {
    if (direction === 'send' && msg.header.msg_type === 'execute_request') window.ddplabRun.sent++;
    if (direction === 'recv' && msg.header.msg_type === 'execute_reply') window.ddplabRun.replies++;
    // The reply comes on the shell channel and can overtake the cell's last outputs; the
    // idle status comes on iopub after all of them.
    if (direction === 'recv' && msg.header.msg_type === 'status'
        && msg.content.execution_state === 'idle'
        && msg.parent_header.msg_type === 'execute_request') window.ddplabRun.idle++;
  });
}"""

KERNEL_IDLE_JS = """name => {
  if (!window.jupyterapp || !window.jupyterapp.shell) return false;   // still loading
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  return !!(panel && panel.content.widgets.length && panel.sessionContext.session
            && panel.sessionContext.session.kernel
            && panel.sessionContext.session.kernel.connectionStatus === 'connected'
            && panel.sessionContext.session.kernel.status === 'idle');
}"""


def rank_labels(text: str) -> list[str]:
    """ddplab's ``[rank N]`` headers, in the order they appear. A late one, output of an earlier
    ``%%rank`` cell shown first because it started first, keeps its note: ``1 (late)``."""
    return [rank + (" (late)" if note else "")
            for rank, note in re.findall(r"\[rank (\d+)\]( \()?", text)]


def in_rank_order(labels: list[str]) -> bool:
    """The output of this cell (late output aside): each rank once, rank 0 first."""
    ranks = [int(label) for label in labels if label.isdigit()]
    return ranks == sorted(set(ranks))


def committed_cells(name: str) -> list[dict]:
    """What the committed notebook shows per cell: its rank labels and its error names."""
    cells = []
    for cell in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells:
        outputs = cell.get("outputs", [])
        stdout = "".join(o.get("text", "") for o in outputs
                         if o.output_type == "stream" and o.name == "stdout")
        cells.append({"labels": rank_labels(stdout),
                      "errors": [o.ename for o in outputs if o.output_type == "error"],
                      "ignore_output": cell.source.startswith("# NBVAL_IGNORE_OUTPUT")})
    return cells


def first_line(cell: dict) -> str:
    return f"cell {cell['index']} ({cell['source'].splitlines()[0] if cell['source'] else ''!r})"


def run_all_cells(page, name: str) -> list[dict]:
    """Run > Run All Cells, through the menus; return the cells once every cell was answered."""
    page.evaluate(WATCH_KERNEL_JS, name)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    deadline = time.monotonic() + RUN_DEADLINE
    while time.monotonic() < deadline:
        run = page.evaluate("window.ddplabRun")
        # idle, not the reply: the reply can overtake the last cell's final outputs
        if run["sent"] and run["replies"] >= run["sent"] and run["idle"] >= run["sent"]:
            return page.evaluate(CELLS_JS, name)
        page.wait_for_timeout(500)                    # polling a condition, with a deadline
    cells = page.evaluate(CELLS_JS, name)
    waiting = [first_line(c) for c in cells if c["type"] == "code" and c["count"] is None]
    raise AssertionError(f"ddplab: Run All Cells did not finish within {RUN_DEADLINE} s: "
                         f"{run['replies']} of {run['sent']} cells answered; still without a "
                         f"result: {', '.join(waiting)}")


def save_screenshots(page, tmp_path: Path, record_property, capsys, failing: bool = False) -> None:
    """What the student sees (the window), and the whole notebook in one tall picture.

    When the test is already failing, a screenshot that cannot be taken is only reported,
    so that the first failure stays the one pytest shows.
    """
    try:
        take_screenshots(page, tmp_path, record_property, capsys)
    except Exception as e:
        if not failing:
            raise
        with capsys.disabled():
            print(f"\n[test_browser] no screenshot: {e}")


def take_screenshots(page, tmp_path: Path, record_property, capsys) -> None:
    shots = {"window": tmp_path / "jupyterlab-window.png",
             "notebook": tmp_path / "jupyterlab-notebook.png"}
    page.screenshot(path=str(shots["window"]), full_page=True)
    # The notebook scrolls inside the window: grow the window until its last cell is in view
    # (not to its scroll height, which has room to scroll past the end that grows with it).
    overflow_js = """() => {
        const outer = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer');
        const cells = outer.querySelectorAll('.jp-Cell');
        outer.scrollTop = 0;
        return new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(
            cells[cells.length - 1].getBoundingClientRect().bottom
            - outer.getBoundingClientRect().bottom)))); }"""
    size = page.viewport_size
    height = size["height"]
    for _ in range(5):                                 # cells may grow once they are drawn
        overflow = page.evaluate(overflow_js)
        if overflow <= 0 or height >= 16000:           # Chromium's largest picture
            break
        height = min(16000, height + int(overflow) + 20)
        page.set_viewport_size({"width": size["width"], "height": height})
    page.screenshot(path=str(shots["notebook"]), full_page=True)
    page.set_viewport_size(size)
    for what, path in shots.items():
        record_property(f"screenshot_{what}", str(path))
        with capsys.disabled():
            print(f"\n[test_browser] screenshot ({what}): {path}")


@pytest.mark.timeout(RUN_DEADLINE + OPEN_DEADLINE + 2 * SERVER_DEADLINE)
def test_notebook_runs_in_jupyterlab_in_chromium(chromium, jupyter_lab, tmp_path,
                                                 record_property, capsys):
    from playwright.sync_api import sync_playwright

    url, token = jupyter_lab
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(OPEN_DEADLINE * 1000)
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_function(KERNEL_IDLE_JS, arg=NOTEBOOK, timeout=OPEN_DEADLINE * 1000)
            try:
                check_page(page, run_all_cells(page, NOTEBOOK))
            except BaseException:
                save_screenshots(page, tmp_path, record_property, capsys, failing=True)
                raise
            save_screenshots(page, tmp_path, record_property, capsys)
        finally:
            browser.close()


def check_page(page, cells: list[dict]) -> None:
    """The three promises to a student: no error but the planned one, rank order, widgets drawn."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    committed = committed_cells(NOTEBOOK)
    assert len(cells) == len(committed), "the page shows another notebook than the committed one"
    code = [c for c in cells if c["type"] == "code"]

    # No cell shows an error, except the one tagged raises-exception, which shows the planned one.
    unexpected = [f"{first_line(c)}: {e['ename']}: {e['evalue'][:300]}"
                  for c in code if "raises-exception" not in c["tags"] for e in c["errors"]]
    not_run = [first_line(c) for c in code if c["count"] is None]
    assert not unexpected, ("cells show errors in JupyterLab:\n" + "\n".join(unexpected)
                            + (f"\nso Run All stopped; never ran: {', '.join(not_run)}" if not_run else ""))
    for c in code:
        if "raises-exception" in c["tags"]:
            names = [e["ename"] for e in c["errors"]]
            assert names == committed[c["index"]]["errors"] and names, (
                f"{first_line(c)} is tagged raises-exception and should show "
                f"{committed[c['index']]['errors']}, but shows {names}")
            assert all(name in c["stderr"] for name in names), f"{first_line(c)}: error not drawn"
    assert not not_run, f"cells never ran: {', '.join(not_run)}"

    # Per-rank output in rank order, and the same rank labels as the committed notebook.
    for c in code:
        labels = rank_labels(c["stdout"])
        assert in_rank_order(labels), f"{first_line(c)}: rank output out of order: {labels}"
        if not committed[c["index"]]["ignore_output"]:
            assert labels == committed[c["index"]]["labels"], (
                f"{first_line(c)}: the page shows rank labels {labels}, the committed notebook "
                f"{committed[c['index']]['labels']}")
        for grid in c["grids"]:
            ranks = [int(row.split()[1]) for row in grid]
            assert ranks == sorted(ranks), f"{first_line(c)}: grid rows out of rank order: {grid}"
    assert any(len(rank_labels(c["stdout"])) > 1 for c in code), "no cell showed output of two ranks"

    # Widgets: every view drawn, none left at "Loading widget..." or the model-not-found placeholder.
    try:
        page.wait_for_function("""() => !Array.from(document.querySelectorAll(
            '.jp-OutputArea-output')).some(n => n.textContent === 'Loading widget...')""", timeout=60_000)
    except PlaywrightTimeout:
        pass                                           # named below, with its cell
    for c in page.evaluate(CELLS_JS, NOTEBOOK):
        for widget in c["widgets"]:
            assert "Error displaying widget" not in widget["text"] and widget["drawn"], (
                f"{first_line(c)}: a widget did not render, it shows {widget['text'][:200]!r}")
    body = page.inner_text("body")
    assert "Error displaying widget" not in body and "model not found" not in body


LIVE_NOTEBOOK = "live_output.ipynb"
LIVE_CELL = ("%%ranks\nimport time\nfor i in range(12):\n"
             "    print(f'rank {rank} line {i}', flush=True)\n    time.sleep(0.5)")

# Whether the cell is still running and what its live areas (text/plain outputs) show now.
LIVE_JS = """name => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  const cell = panel.content.widgets[1];
  return {
    running: window.ddplabRun.replies < window.ddplabRun.sent,
    live: Array.from(cell.node.querySelectorAll('.jp-OutputArea-output[data-mime-type="text/plain"]'))
               .map(n => n.textContent),
    stdout: Array.from(cell.node.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"]'))
               .map(n => n.textContent).join(''),
    outputs: cell.model.outputs.toJSON().map(o => JSON.stringify(o).slice(0, 200)),
  };
}"""


@pytest.mark.timeout(OPEN_DEADLINE + 2 * SERVER_DEADLINE + 300)
def test_live_output_shows_while_the_cell_runs(chromium, jupyter_lab, tmp_path,
                                               record_property, capsys):
    """Rank 0's first line is on the page while its %%ranks cell is still running."""
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
                    "import ddplab\nlab = ddplab.start(world_size=2, backend='gloo', timeout=120)"),
                nbformat.v4.new_code_cell(LIVE_CELL)]
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"}}
    nbformat.write(nb, str(tmp_path / "workspace" / LIVE_NOTEBOOK))
    url, token = jupyter_lab
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(OPEN_DEADLINE * 1000)
            page.goto(f"{url}/lab/tree/{LIVE_NOTEBOOK}?token={token}")
            page.wait_for_function(KERNEL_IDLE_JS, arg=LIVE_NOTEBOOK, timeout=OPEN_DEADLINE * 1000)
            page.evaluate(WATCH_KERNEL_JS, LIVE_NOTEBOOK)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            seen, deadline, states = None, time.monotonic() + 240, []
            while time.monotonic() < deadline:
                state = page.evaluate(LIVE_JS, LIVE_NOTEBOOK)
                states.append(state)
                if state["running"] and state["live"] and "rank 0 line 0" in state["live"][0]:
                    seen = state
                    break
                if state["stdout"]:                   # the cell ended before we saw it live
                    break
                page.wait_for_timeout(100)            # polling a condition, with a deadline
            try:
                assert seen is not None, f"rank 0's line never showed while the cell ran: {states[-15:]}"
                assert seen["live"][0].startswith("[rank 0] (running)"), seen
                assert not seen["stdout"], seen
                # idle, not the reply: the reply can arrive before the last of the output.
                page.wait_for_function("() => window.ddplabRun.idle >= window.ddplabRun.sent",
                                       timeout=240_000)
                done = page.evaluate(LIVE_JS, LIVE_NOTEBOOK)
                assert rank_labels(done["stdout"]) == ["0", "1"], done
                assert "rank 1 line 11" in done["stdout"]
                assert not any(text.strip() for text in done["live"]), done   # areas emptied
            except BaseException:
                save_screenshots(page, tmp_path, record_property, capsys, failing=True)
                raise
        finally:
            browser.close()
