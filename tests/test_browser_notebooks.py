"""A notebook run the way a student runs it: JupyterLab and Notebook 7 in a real browser.

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

It saves screenshots under the test's tmp_path and prints their paths. A student copy opened
and not run shows no check result (no ``Correct``), only the outputs its own run would print.

The learner's loop (issue 53) is walked too: a wrong answer and its check, where the page must
show the check's feedback as one block (its headline, no ``Traceback``, none of ddplab's frames),
then the answer fixed and run again, where it must show the check's pass line.

Jupyter Notebook 7 gets the same walk through notebook 00 and the same live-output test: one
server serves both, since ``jupyter lab`` also serves Notebook 7's pages (``/notebooks/<path>``)
when the ``notebook`` package is installed, and Notebook 7 is made of JupyterLab's components
(the same cells, output areas, menus and kernel messages), so browserkit's selectors and
checks hold there unchanged. The one difference the test needs: Notebook 7 is another server
extension, with its own ``expose_app_in_browser`` setting. One server serves the whole module;
after each test the kernels it started are shut down, so no lab outlives its test. The server
is started and ended by tests/jupyterkit.py; JupyterLab as ``make lab`` starts it for a student:
tests/test_browser_make_lab.py.

The browser is Debian's ``chromium`` at /usr/bin/chromium, never one that
Playwright downloads. ``make test`` installs it when missing
(tools/ensure_chromium.sh) and sets DDPLAB_REQUIRE_BROWSER=1, so there (and
wherever CI is set) a missing browser fails the test. Run by hand without
Chromium, the test skips and says why.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from browserkit import (
    CHROMIUM_FLAGS,
    KERNEL_IDLE_JS,
    WATCH_KERNEL_JS,
    answer_every_exercise,
    check_page,
    rank_labels,
    run_all_cells,
    save_screenshots,
)
from conftest import lab_dirs, my_process_tree
from jupyterkit import (
    JUPYTER,
    NOTEBOOK7,
    OPEN_DEADLINE,
    PAGES,
    RUN_DEADLINE,
    SERVER_DEADLINE,
    Server,
    api,
    end_processes,
    lab_env,
    wait_for_server,
)

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
# The newest notebook that exercises the most: 01 has a deadlock demo, 00 is the fallback.
NOTEBOOK = next(name for name in ("01_point_to_point.ipynb", "00_setup.ipynb")
                if (ROOT / "notebooks" / name).exists())


@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory):
    """A JupyterLab server on a student workspace, made as `make lab` makes it (ddplab notebooks),
    with every exercise of the walked notebooks answered as a student who solved it would: the
    reference solution in place of the stub. The same server serves Notebook 7's pages. Always
    shut down, with its kernels, even when a test fails.
    """
    tmp_path = tmp_path_factory.mktemp("jupyter")
    notebooks = tmp_path / "workspace"
    subprocess.run([sys.executable, "-m", "ddplab", "notebooks", str(notebooks)], check=True,
                   capture_output=True, timeout=120)
    for name in {NOTEBOOK, NOTEBOOK7}:
        answer_every_exercise(notebooks / name)
    env = lab_env(tmp_path / "jupyter")
    token = secrets.token_hex(24)
    log = tmp_path / "jupyterlab.log"
    command = [str(JUPYTER), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               "--ServerApp.port=0", f"--IdentityProvider.token={token}",
               f"--notebook-dir={notebooks}",
               "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               # Lets the test read the notebook model (cell tags, outputs, kernel messages)
               # in the page, as JupyterLab's own UI tests (Galata) do; Notebook 7 is another
               # server extension with a setting of its own.
               "--LabApp.expose_app_in_browser=True",
               "--JupyterNotebookApp.expose_app_in_browser=True"]
    if os.getuid() == 0:
        command.append("--allow-root")
    started, dirs_before = my_process_tree(), lab_dirs()
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_for_server(proc, Path(env["JUPYTER_RUNTIME_DIR"]), token, log)
        yield Server(url, token, notebooks)
    finally:
        end_processes(proc, started)
    left = lab_dirs() - dirs_before
    assert not left, f"the kernel's lab left its directory behind: {sorted(left)}"


@pytest.fixture
def jupyter_lab(jupyter_server):
    """The module's server, for one test, as a fresh server would be: afterwards it shuts down
    every kernel (as File > Shut Down Kernel would; each kernel's exit stops its lab, whose
    directory must then be gone) and forgets JupyterLab's saved layout, which would reopen the
    test's notebooks, and start their kernels, in the next test's page."""
    dirs_before = lab_dirs()
    yield jupyter_server
    sessions = api(jupyter_server, "api/sessions")
    for session in sessions:                                # each answers once its kernel ended
        api(jupyter_server, f"api/sessions/{session['id']}", method="DELETE")
    for kernel in api(jupyter_server, "api/kernels"):
        api(jupyter_server, f"api/kernels/{kernel['id']}", method="DELETE")
    for workspace in api(jupyter_server, "lab/api/workspaces")["workspaces"]["ids"]:
        api(jupyter_server, f"lab/api/workspaces/{workspace}", method="DELETE")
    deadline = time.monotonic() + SERVER_DEADLINE
    while lab_dirs() - dirs_before and time.monotonic() < deadline:
        time.sleep(0.25)                               # polling a condition, with a deadline
    left = lab_dirs() - dirs_before
    assert not left, f"a kernel's lab left its directory behind after its shutdown: {sorted(left)}"
    # One notebook per test: a second means a page reopened an earlier test's notebook.
    assert len(sessions) <= 1, f"kernels for {[s['path'] for s in sessions]}: one test, one notebook"


def walk(chromium: str, server: Server, page_path: str, notebook: str, tmp_path: Path,
         record_property, capsys, name: str) -> None:
    """Open ``notebook`` at ``page_path`` (JupyterLab's or Notebook 7's), Run All Cells from the
    menus and check the page (browserkit.check_page); screenshots in ``tmp_path``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(OPEN_DEADLINE * 1000)
            page.goto(f"{server.url}/{page_path}/{notebook}?token={server.token}")
            page.wait_for_function(KERNEL_IDLE_JS, arg=notebook, timeout=OPEN_DEADLINE * 1000)
            try:
                check_page(page, run_all_cells(page, notebook, RUN_DEADLINE), notebook)
            except BaseException:
                save_screenshots(page, tmp_path, record_property, capsys, failing=True, name=name)
                raise
            save_screenshots(page, tmp_path, record_property, capsys, name=name)
        finally:
            browser.close()


@pytest.mark.timeout(RUN_DEADLINE + OPEN_DEADLINE + 2 * SERVER_DEADLINE)
def test_notebook_runs_in_jupyterlab_in_chromium(chromium, jupyter_lab, tmp_path,
                                                 record_property, capsys):
    walk(chromium, jupyter_lab, PAGES["jupyterlab"], NOTEBOOK, tmp_path, record_property, capsys,
         name="jupyterlab")


@pytest.mark.timeout(RUN_DEADLINE + OPEN_DEADLINE + 2 * SERVER_DEADLINE)
def test_notebook_00_runs_in_notebook7_in_chromium(chromium, jupyter_lab, tmp_path,
                                                   record_property, capsys):
    """Jupyter Notebook 7 (``/notebooks/<path>``, Run > Run All Cells): the same promises."""
    walk(chromium, jupyter_lab, PAGES["notebook7"], NOTEBOOK7, tmp_path, record_property, capsys,
         name="notebook7")


# A student copy as it opens, before any cell ran: notebook 12 is untouched in the workspace.
FRESH_NOTEBOOK = "12_build_ddp_zero_fsdp.ipynb"
# What the open notebook shows: the model's outputs and the text drawn, per code cell.
SHOWN_JS = """name => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  return panel.content.widgets.filter(cell => cell.model.type === 'code').map(cell => ({
    id: cell.model.id, count: cell.model.executionCount,
    outputs: JSON.stringify(cell.model.outputs.toJSON()),
    drawn: (cell.node.querySelector('.jp-Cell-outputArea') || {textContent: ''}).textContent,
  }));
}"""


@pytest.mark.timeout(OPEN_DEADLINE + 2 * SERVER_DEADLINE)
def test_a_student_copy_shows_no_check_result_before_it_runs(chromium, jupyter_lab):
    """Issue 53: the workspace's copy of a notebook, opened and not run, shows no `Correct` and
    nothing computed from a solution (12's `your Zero1Adam` bytes), while its demos' outputs
    that a stub run prints too are there."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(OPEN_DEADLINE * 1000)
            page.goto(f"{jupyter_lab.url}/{PAGES['jupyterlab']}/{FRESH_NOTEBOOK}?token={jupyter_lab.token}")
            page.wait_for_function(KERNEL_IDLE_JS, arg=FRESH_NOTEBOOK, timeout=OPEN_DEADLINE * 1000)
            cells = page.evaluate(SHOWN_JS, FRESH_NOTEBOOK)
            shown = page.evaluate("() => Array.from(document.querySelectorAll('.jp-OutputArea'))"
                                  ".map(n => n.textContent).join('\\n')")
        finally:
            browser.close()
    assert "Correct" not in shown and not re.search(r"your Zero1Adam [\d,]+ B", shown), shown[-2000:]
    graded = [c for c in cells if c["id"].startswith(("exercise-", "check-"))]
    assert graded and all(c["outputs"] == "[]" and c["count"] is None for c in graded), graded
    for cell in cells:
        assert "Correct" not in cell["outputs"] + cell["drawn"], cell["id"]
    drawn = [c["id"] for c in cells if c["drawn"].strip()]
    assert "cell-03" in drawn, f"the demo before the first exercise lost its output: {drawn}"


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
@pytest.mark.parametrize("front_end", ["jupyterlab", "notebook7"])
def test_live_output_shows_while_the_cell_runs(chromium, jupyter_lab, front_end, tmp_path,
                                               record_property, capsys):
    """Rank 0's first line is on the page while its %%ranks cell is still running."""
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
                    "import ddplab\nlab = ddplab.start(world_size=2, backend='gloo', timeout=120)"),
                nbformat.v4.new_code_cell(LIVE_CELL)]
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"}}
    nbformat.write(nb, str(jupyter_lab.workspace / LIVE_NOTEBOOK))
    url, token = jupyter_lab.url, jupyter_lab.token
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(OPEN_DEADLINE * 1000)
            page.goto(f"{url}/{PAGES[front_end]}/{LIVE_NOTEBOOK}?token={token}")
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
                save_screenshots(page, tmp_path, record_property, capsys, failing=True,
                                 name=f"live-{front_end}")
                raise
        finally:
            browser.close()


LOOP_NOTEBOOK = "feedback_loop.ipynb"
LOOP_WRONG = "def swap(t):\n    other = 1 - rank          # the commonest slip: `rank` inside a function\n    return t"
LOOP_RIGHT = ("def swap(t):\n    import torch.distributed as dist\n    other = 1 - dist.get_rank()\n"
              "    received = torch.empty_like(t)\n"
              "    requests = [dist.isend(t, dst=other), dist.irecv(received, src=other)]\n"
              "    for request in requests:\n        request.wait()\n    return received")
LOOP_PASS = "Correct: each rank returned the other rank's tensor and kept its own."
# What the check cell's output area shows, as drawn, and the errors in its model.
OUTPUT_JS = """name => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  const cell = panel.content.widgets[2];
  return {text: cell.node.querySelector('.jp-OutputArea').innerText,
          errors: cell.model.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename)};
}"""
# A student's edit of the answer cell, then Shift+Enter on it and on its check.
FIX_JS = """([name, source]) => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  panel.content.widgets[1].model.sharedModel.setSource(source);
  panel.content.activeCellIndex = 1;
  return window.jupyterapp.commands.execute('notebook:run-cell-and-select-next').then(
    () => window.jupyterapp.commands.execute('notebook:run-cell-and-select-next'));
}"""


@pytest.mark.timeout(RUN_DEADLINE + OPEN_DEADLINE + 2 * SERVER_DEADLINE)
def test_a_wrong_answer_shows_its_feedback_and_the_fix_its_pass_line(chromium, jupyter_lab, tmp_path,
                                                                    record_property, capsys):
    """In JupyterLab: the check of a wrong answer shows the feedback block (headline first, no
    Traceback, no frame of ddplab's checker code); fixed and run again, the check's pass line."""
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import ddplab\nimport torch\n"
                                          "lab = ddplab.start(world_size=2, backend='gloo', timeout=120)"),
                nbformat.v4.new_code_cell(LOOP_WRONG),
                nbformat.v4.new_code_cell("ddplab.check.swap_tensors(swap)")]
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"}}
    nbformat.write(nb, str(jupyter_lab.workspace / LOOP_NOTEBOOK))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(OPEN_DEADLINE * 1000)
            page.goto(f"{jupyter_lab.url}/{PAGES['jupyterlab']}/{LOOP_NOTEBOOK}?token={jupyter_lab.token}")
            page.wait_for_function(KERNEL_IDLE_JS, arg=LOOP_NOTEBOOK, timeout=OPEN_DEADLINE * 1000)
            try:
                run_all_cells(page, LOOP_NOTEBOOK, RUN_DEADLINE)
                wrong = page.evaluate(OUTPUT_JS, LOOP_NOTEBOOK)
                assert wrong["errors"] == ["Feedback"], wrong
                shown = wrong["text"]
                assert shown.startswith("NameError: name 'rank' is not defined"), shown
                assert "other = 1 - rank" in shown and "dist.get_rank()" in shown, shown
                for frame in ("Traceback", "ddplab/check", "_core.py", "File \""):
                    assert frame not in shown, f"the feedback shows {frame!r}:\n{shown}"
                save_screenshots(page, tmp_path, record_property, capsys, name="loop-wrong")

                page.evaluate(WATCH_KERNEL_JS, LOOP_NOTEBOOK)
                page.evaluate(FIX_JS, [LOOP_NOTEBOOK, LOOP_RIGHT])
                page.wait_for_function("() => window.ddplabRun.sent >= 2 && "
                                       "window.ddplabRun.idle >= window.ddplabRun.sent",
                                       timeout=RUN_DEADLINE * 1000)
                fixed = page.evaluate(OUTPUT_JS, LOOP_NOTEBOOK)
                assert fixed["errors"] == [] and fixed["text"].strip() == LOOP_PASS, fixed
            except BaseException:
                save_screenshots(page, tmp_path, record_property, capsys, failing=True, name="loop")
                raise
            save_screenshots(page, tmp_path, record_property, capsys, name="loop-fixed")
        finally:
            browser.close()
