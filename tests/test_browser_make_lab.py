"""JupyterLab as ``make lab`` starts it, for a student, in a real browser: no nbgrader, no news.

A server of its own on a workspace ``ddplab notebooks`` made (tests/jupyterkit.py), its page
opened in Debian's headless Chromium through Playwright (tests/browserkit.py), as
tests/test_browser_notebooks.py opens the notebooks it runs. Run by hand without Chromium, the
test skips and says why.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from browserkit import CHROMIUM_FLAGS, KERNEL_IDLE_JS, save_screenshots
from conftest import my_process_tree
from jupyterkit import (
    JUPYTER,
    NOTEBOOK7,
    OPEN_DEADLINE,
    PAGES,
    SERVER_DEADLINE,
    Server,
    api,
    end_processes,
    lab_env,
    wait_for_server,
)

pytestmark = pytest.mark.browser


# What a student's JupyterLab must not show (issue 57): nbgrader's plugins (its menu, the
# Validate button, the Create Assignment panel...) and the announcements' news question.
STUDENT_HIDDEN = ("@jupyter/nbgrader:assignment-list", "@jupyter/nbgrader:course-list",
                  "@jupyter/nbgrader:create-assignment", "@jupyter/nbgrader:formgrader",
                  "@jupyter/nbgrader:menu", "@jupyter/nbgrader:validate-assignment",
                  "@jupyterlab/apputils-extension:announcements")
STUDENT_PAGE_JS = """name => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === name);
  return {
    plugins: window.jupyterapp.listPlugins(),
    installed: JSON.parse(document.getElementById('jupyter-config-data').textContent)
                   .federated_extensions.map(e => e.name),
    toolbar: Array.from(panel.toolbar.node.querySelectorAll('button, .jp-ToolbarButtonComponent-label'))
                  .map(n => (n.textContent || '') + ' ' + (n.title || '')).join(' | '),
    sides: ['left', 'right'].flatMap(area => Array.from(window.jupyterapp.shell.widgets(area))
                  .map(w => `${w.title.label} ${w.title.caption} ${w.id}`)),
    toasts: Array.from(document.querySelectorAll('.Toastify__toast')).map(n => n.textContent),
  };
}"""


@pytest.mark.timeout(OPEN_DEADLINE + 2 * SERVER_DEADLINE + 120)
def test_make_labs_jupyterlab_shows_a_student_notebook_without_nbgrader_or_news(chromium, tmp_path,
                                                                                  record_property, capsys):
    """JupyterLab as ``make lab`` starts it, on a workspace ``ddplab notebooks`` made: the
    workspace's settings (``JUPYTER_CONFIG_PATH``, ddplab/course/lab_settings.py) hide
    nbgrader, which this environment (make test's profile) has installed, and the news question.
    Nothing here pre-answers the question: the settings where lab_env answers it are left out."""
    from playwright.sync_api import sync_playwright

    from ddplab.course.lab_settings import CONFIG_FOLDER

    workspace = tmp_path / "workspace"
    subprocess.run([sys.executable, "-m", "ddplab", "notebooks", str(workspace)], check=True,
                   capture_output=True, timeout=120)
    env = lab_env(tmp_path / "jupyter")
    env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp_path / "jupyter" / "student-settings")
    env["JUPYTER_CONFIG_PATH"] = str(workspace / CONFIG_FOLDER)           # as the Makefile's lab
    token = secrets.token_hex(24)
    log = tmp_path / "jupyterlab.log"
    command = [str(JUPYTER), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
               f"--IdentityProvider.token={token}", f"--notebook-dir={workspace}",
               "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.getuid() == 0 else [])
    started = my_process_tree()
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        server = Server(wait_for_server(proc, Path(env["JUPYTER_RUNTIME_DIR"]), token, log), token,
                        workspace)
        request = urllib.request.Request(f"{server.url}/formgrader",
                                         headers={"Authorization": f"token {token}"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                formgrader = response.status
        except urllib.error.HTTPError as e:
            formgrader = e.code
        assert formgrader == 404, f"nbgrader's formgrader page is served (HTTP {formgrader})"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                                 headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(OPEN_DEADLINE * 1000)
                page.goto(f"{server.url}/{PAGES['jupyterlab']}/{NOTEBOOK7}?token={token}")
                page.wait_for_function(KERNEL_IDLE_JS, arg=NOTEBOOK7, timeout=OPEN_DEADLINE * 1000)
                page.evaluate("() => window.jupyterapp.restored")
                seen = page.evaluate(STUDENT_PAGE_JS, NOTEBOOK7)
                try:
                    assert "@jupyter/nbgrader" in seen["installed"], (
                        f"nbgrader is not installed here, so this test shows nothing: run it in make "
                        f"test's environment (the test profile). Installed: {seen['installed']}")
                    shown = sorted(set(STUDENT_HIDDEN) & set(seen["plugins"]))
                    assert not shown, f"a student's JupyterLab runs these plugins: {shown}"
                    assert page.get_by_role("menuitem", name="Nbgrader").count() == 0
                    assert "Validate" not in seen["toolbar"], seen["toolbar"]
                    assert not [s for s in seen["sides"] if "assignment" in s.lower()], seen["sides"]
                    assert not [t for t in seen["toasts"] if "news" in t.lower()], seen["toasts"]
                    assert "Jupyter news" not in page.inner_text("body")
                except BaseException:
                    save_screenshots(page, tmp_path, record_property, capsys, failing=True, name="student")
                    raise
                save_screenshots(page, tmp_path, record_property, capsys, name="student")
            finally:
                browser.close()
        for session in api(server, "api/sessions"):
            api(server, f"api/sessions/{session['id']}", method="DELETE")
    finally:
        end_processes(proc, started)
