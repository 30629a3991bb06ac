"""Driving JupyterLab in Debian's Chromium: what the browser tests share.

``tests/test_browser_*.py`` (JupyterLab servers of their own) and ``tests/test_hub.py`` (three
students on a real JupyterHub) open notebooks through Playwright in Debian's
headless Chromium at /usr/bin/chromium, never a browser Playwright downloads,
run every cell from the menus and read the page: JupyterLab's own model of each
cell (``--LabApp.expose_app_in_browser=True`` puts the app in ``window``, as
JupyterLab's UI tests, Galata, do) and what is drawn. The ``chromium`` fixture
is in conftest.py.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def browser_required() -> bool:
    """Under `make test` (and CI) a missing browser is a failure, never a skip."""
    return (os.environ.get("DDPLAB_REQUIRE_BROWSER") == "1"
            or os.environ.get("CI", "").lower() in ("1", "true", "yes"))


def require_chromium() -> str:
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


def answer_every_exercise(path: Path) -> None:
    """Put the reference's exercise cells into the student version at path."""
    reference = {c.get("id"): c for c in nbformat.read(ROOT / "notebooks" / path.name, as_version=4).cells}
    student = nbformat.read(path, as_version=4)
    for cell in student.cells:
        if cell.get("id", "").startswith("exercise-"):
            assert "NotImplementedError" in cell.source, "the workspace holds the reference"
            cell.source = reference[cell.id].source
    nbformat.write(student, path)


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


def start_run_all(page, name: str) -> None:
    """Run > Run All Cells, through the menus; ``run_finished`` then says when it is done."""
    page.evaluate(WATCH_KERNEL_JS, name)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def run_finished(page) -> bool:
    """Whether every cell sent since ``start_run_all`` was answered, outputs and all."""
    run = page.evaluate("window.ddplabRun")
    # idle, not the reply: the reply can overtake the last cell's final outputs
    return bool(run["sent"]) and run["replies"] >= run["sent"] and run["idle"] >= run["sent"]


def not_finished(page, name: str, deadline_s: float) -> AssertionError:
    """The error for a Run All that did not finish in time: which cells never got a result."""
    run = page.evaluate("window.ddplabRun")
    cells = page.evaluate(CELLS_JS, name)
    waiting = [first_line(c) for c in cells if c["type"] == "code" and c["count"] is None]
    return AssertionError(f"ddplab: Run All Cells in {name} did not finish within {deadline_s} s: "
                          f"{run['replies']} of {run['sent']} cells answered; still without a "
                          f"result: {', '.join(waiting)}")


def run_all_cells(page, name: str, deadline_s: float) -> list[dict]:
    """Run > Run All Cells, through the menus; return the cells once every cell was answered."""
    start_run_all(page, name)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if run_finished(page):
            return page.evaluate(CELLS_JS, name)
        page.wait_for_timeout(500)                    # polling a condition, with a deadline
    raise not_finished(page, name, deadline_s)


def save_screenshots(page, folder: Path, record_property, capsys, failing: bool = False,
                     name: str = "jupyterlab") -> None:
    """What the student sees (the window), and the whole notebook in one tall picture.

    When the test is already failing, a screenshot that cannot be taken is only reported,
    so that the first failure stays the one pytest shows.
    """
    try:
        take_screenshots(page, folder, record_property, capsys, name)
    except Exception as e:
        if not failing:
            raise
        with capsys.disabled():
            print(f"\n[browser] no screenshot: {e}")


def take_screenshots(page, folder: Path, record_property, capsys, name: str = "jupyterlab") -> None:
    shots = {"window": folder / f"{name}-window.png", "notebook": folder / f"{name}-notebook.png"}
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
        record_property(f"screenshot_{name}_{what}", str(path))
        with capsys.disabled():
            print(f"\n[browser] screenshot ({what}): {path}")


def check_page(page, cells: list[dict], notebook: str) -> None:
    """The three promises to a student: no error but the planned one, rank order, widgets drawn."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    committed = committed_cells(notebook)
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
    for c in page.evaluate(CELLS_JS, notebook):
        for widget in c["widgets"]:
            assert "Error displaying widget" not in widget["text"] and widget["drawn"], (
                f"{first_line(c)}: a widget did not render, it shows {widget['text'][:200]!r}")
    body = page.inner_text("body")
    assert "Error displaying widget" not in body and "model not found" not in body
