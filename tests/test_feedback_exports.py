"""The same feedback wherever a grade goes (issue 53): what a student saw in the notebook is what
``ddplab grade``'s report, its CSV, JUnit, Gradescope's ``results.json`` and nbgrader's feedback say.

One small course notebook with three exercises of the real course (00's mean_score, 01's ring
token, 12's overlap_hooks) and a submission that gets one wrong in a way that fails the same every
run (the mean of the ranks' means), one right, and 12's wrong (gradients averaged twice). The
submission runs once in a kernel as a student runs it (nbclient: the notebook's own outputs), and
is graded once by ``ddplab grade`` with every export; each export must hold the notebook's text,
the failure's whole (headline, table, hint) and the pass line, and Gradescope's output for the
wrong overlap_hooks the named mistake and its hint.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")

SETUP = ("# NBVAL_IGNORE_OUTPUT\nimport ddplab\nimport torch\nimport torch.distributed as dist\n"
         "lab = ddplab.start(world_size=2, backend=\"gloo\")")
SCORES = "%%ranks\nscores = torch.arange(1.0, 3.0 + 2 * rank)"
MEAN_RIGHT = ("totals = torch.tensor([scores.sum().item(), float(len(scores))])\n"
              "dist.all_reduce(totals)\nmean_score = totals[:1] / totals[1]")
MEAN_OF_MEANS = "mean_score = scores.mean().reshape(1)\ndist.all_reduce(mean_score)\nmean_score /= world_size"
RING = ("left, right = (rank - 1) % world_size, (rank + 1) % world_size\nif rank == 0:\n"
        "    token = torch.tensor([0.0])\n    dist.send(token, dst=right)\n    dist.recv(token, src=left)\n"
        "else:\n    token = torch.zeros(1)\n    dist.recv(token, src=left)\n    token += rank\n"
        "    dist.send(token, dst=right)")
OVERLAP = ("def overlap_hooks(model):\n    handles = []\n    def hook(p):\n"
           "        p.grad /= {divide}\n        handles.append(dist.all_reduce(p.grad, async_op=True))\n"
           "    for p in model.parameters():\n        p.register_post_accumulate_grad_hook(hook)\n"
           "    return handles\n\n\ndef wait_for_gradients(handles):\n    for handle in handles:\n"
           "        handle.wait()\n    handles.clear()")
PASSES = {"mean-score": "Correct: every rank holds the mean of all 6 scores of the 2 ranks.",
          "ring-token": "Correct: the token went once around the ring of 2 ranks.",
          "overlap": ("Correct: overlap_hooks: each gradient's all_reduce started inside backward(), every "
                      "handle was waited for, and after 3 steps the weights on every rank are one "
                      "process's (float64, 1e-12).")}
CHECKS = {"mean-score": "ddplab.check.mean_score()", "ring-token": "ddplab.check.ring_token()",
          "overlap": "ddplab.check.overlap_hooks(overlap_hooks, wait_for_gradients)"}


def _notebook(answers: dict[str, str], reference: bool) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_code_cell(SETUP, id="cell-setup"),
             nbformat.v4.new_code_cell(SCORES, id="cell-scores")]
    for name, answer in answers.items():
        prefix = "%%ranks --timeout 15\n" if name != "overlap" else ""
        body = f"### BEGIN SOLUTION\n{answer}\n### END SOLUTION" if reference else answer
        cells.append(nbformat.v4.new_code_cell(prefix + body, id=f"exercise-{name}",
                                               metadata={"tags": ["exercise"]}))
        cells.append(nbformat.v4.new_code_cell(CHECKS[name], id=f"check-{name}", metadata={"tags": ["check"]},
                                               outputs=[nbformat.v4.new_output(
                                                   "stream", name="stdout", text=PASSES[name] + "\n")]
                                               if reference else []))
    cells.append(nbformat.v4.new_code_cell("lab.stop()", id="cell-stop"))
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The submission as the notebook shows it (run by nbclient) and as every export says it."""
    from nbclient import NotebookClient

    folder = tmp_path_factory.mktemp("exports")
    (folder / "ref").mkdir()
    (folder / "sub" / "alice").mkdir(parents=True)
    right = {"mean-score": MEAN_RIGHT, "ring-token": RING,
             "overlap": OVERLAP.format(divide="dist.get_world_size()")}
    wrong = {"mean-score": MEAN_OF_MEANS, "ring-token": RING,
             "overlap": OVERLAP.format(divide="dist.get_world_size() ** 2")}
    nbformat.write(_notebook(right, reference=True), folder / "ref" / "course.ipynb")
    submission = _notebook(wrong, reference=False)
    nbformat.write(submission, folder / "sub" / "alice" / "course.ipynb")

    run = folder / "run"
    run.mkdir()
    executed = nbformat.reads(nbformat.writes(submission), as_version=4)
    NotebookClient(executed, timeout=600, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(run)}}).execute()

    out = {name: folder / name for name in ("grades.csv", "junit.xml", "results.json")}
    result = subprocess.run([sys.executable, "-m", "ddplab", "grade", str(folder / "sub" / "alice"),
                             "--reference", str(folder / "ref"), "--csv", str(out["grades.csv"]),
                             "--junit", str(out["junit.xml"]), "--gradescope", str(out["results.json"])],
                            capture_output=True, text=True, timeout=900, cwd=folder,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1, result.stdout + result.stderr[-4000:]     # 1: an exercise was lost
    return executed, result.stdout, out


def _cell(nb, cell_id: str):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def _shown(nb, cell_id: str) -> tuple[str, str]:
    """What the notebook shows under a check cell: (the error block, the printed text)."""
    outputs = _cell(nb, cell_id).outputs
    errors = [ANSI.sub("", "\n".join(o.traceback)) for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream").strip()
    return (errors[0] if errors else ""), printed


def _report_block(report: str, exercise: str) -> str:
    """A lost exercise's reason in the report table, its continuation lines' indent removed."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"alice\s+{exercise}: ", line))
    head = re.match(rf"alice\s+{exercise}: ", lines[start]).group(0)
    block = [lines[start][len(head):]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * len(head)) or not line.strip():
            break
        block.append(line[len(head):])
    return "\n".join(block)


def test_the_notebook_shows_one_block_and_the_pass_line(graded):
    nb, _, _ = graded
    failed, _ = _shown(nb, "check-mean-score")
    assert failed.startswith("mean_score holds the mean of the ranks' means, not the mean of all scores, "
                             "on ranks 0, 1."), failed
    assert "Hint: every rank holds a different number of scores" in failed
    assert "Traceback" not in failed and "ddplab/check" not in failed and "File " not in failed
    assert _shown(nb, "check-ring-token") == ("", PASSES["ring-token"])


def test_every_export_holds_the_notebooks_text(graded):
    nb, report, out = graded
    failed, _ = _shown(nb, "check-mean-score")
    passed = _shown(nb, "check-ring-token")[1]

    assert _report_block(report, "mean-score") == "check: " + failed          # ddplab grade's report

    rows = list(csv.DictReader(io.StringIO(out["grades.csv"].read_text())))
    assert rows[0]["mean-score"] == "0" and rows[0]["ring-token"] == "1"
    assert "mean-score: check: " + failed in rows[0]["reasons"]                # the CSV

    cases = {c.get("name"): c for c in ET.parse(out["junit.xml"]).getroot().iter("testcase")}
    failure = cases["mean-score"].find("failure")
    assert failure.text == "check: " + failed                                   # JUnit: the whole text,
    assert failure.get("message") == "check: " + failed.splitlines()[0]        # the headline as message
    assert cases["ring-token"].find("system-out").text == passed

    tests = {t["name"].split(": ", 1)[1]: t for t in json.loads(out["results.json"].read_text())["tests"]}
    assert tests["mean-score"]["output"] == "check: " + failed                  # Gradescope
    assert tests["ring-token"]["output"] == passed and tests["ring-token"]["score"] == 1


def test_gradescope_names_the_wrong_overlap_hooks_mistake_and_its_hint(graded):
    from ddplab.check.nb12_build_ddp_zero_fsdp.ddp import OVERLAP_HINT

    nb, _, out = graded
    tests = {t["name"].split(": ", 1)[1]: t for t in json.loads(out["results.json"].read_text())["tests"]}
    said = tests["overlap"]["output"]
    assert tests["overlap"]["score"] == 0
    mistake = "overlap_hooks: the gradients were averaged twice (divided by world_size twice)."
    assert said.startswith("check: " + mistake), said
    assert "\nHint: " + OVERLAP_HINT in said
    failed, _ = _shown(nb, "check-overlap")                  # the notebook said the same (the
    assert failed.splitlines()[0] == mistake                   # distances differ: batches are drawn
    assert failed.splitlines()[-1] == "Hint: " + OVERLAP_HINT  # per run)


def test_nbgraders_feedback_shows_the_notebooks_block(graded):
    """nbgrader's feedback is its HTML of the graded notebook (``generate_feedback``'s exporter and
    template): the error block is the check's feedback, with no stack of ddplab's."""
    import html

    import nbgrader
    from nbconvert import HTMLExporter

    nb, _, _ = graded
    formgrader = Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
    exporter = HTMLExporter(template_name="feedback", extra_template_basedirs=[str(formgrader / "templates")],
                            extra_template_paths=[str(formgrader / "static" / "node_modules" / "bootstrap"
                                                      / "dist" / "css")])
    # What nbgrader's GetGrades preprocessor puts in the resources, for the template's header.
    grades = {"notebook": "course", "score": 1, "max_score": 3, "late_penalty": 0}
    page, _ = exporter.from_notebook_node(nb, resources={"nbgrader": grades})
    body = re.sub(r"<(style|script)\b[^>]*>.*?</\1>", "", page, flags=re.S)    # the page's text only
    text = html.unescape(re.sub(r"<[^>]+>", "", body))
    failed, _ = _shown(nb, "check-mean-score")
    assert failed in text
    assert PASSES["ring-token"] in text
    assert "Traceback" not in text and "ddplab/check/" not in text
