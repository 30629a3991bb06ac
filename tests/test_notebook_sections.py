"""The notebook that proves every exercise section runs after a ``lab.restart()`` (tests/sections.py).

These tests read the notebooks only. The execution itself is nbgrader's
``autograde`` of the reference (tests/test_nbgrader.py,
``test_every_exercise_section_runs_after_a_restart``), which runs the course
once for both purposes rather than once each.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from sections import ADDED, AFTER_RESTART, RESTART_FROM, failures, restart_points, with_restarts

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def _read(name: str):
    return nbformat.read(ROOT / "notebooks" / name, as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_restart_precedes_each_exercise_section_and_the_rest_is_the_notebook(name):
    nb = _read(name)
    points = restart_points(name, nb.cells)
    out = with_restarts(nb, name)
    restarts = [c for c in out.cells if c.metadata.get("ddplab", {}).get("restart_before")]
    assert [c.metadata["ddplab"]["restart_before"] for c in restarts] == list(points)
    assert all(c.source == "lab.restart()" for c in restarts)
    kept = [c for c in out.cells if not c.get("id", "").startswith(ADDED)]
    assert [(c.id, c.source) for c in kept] == [(c.id, c.source) for c in nb.cells]
    ids = [c.id for c in out.cells]
    assert len(ids) == len(set(ids)), f"{name}: a cell id appears twice"
    grade_ids = [c.metadata["nbgrader"]["grade_id"] for c in out.cells if "nbgrader" in c.metadata]
    assert len(grade_ids) == len(set(grade_ids)), f"{name}: a copy kept its nbgrader grade id"
    nbformat.validate(out)


def test_the_lab_is_restarted_only_once_it_was_started_and_only_before_exercises():
    points = restart_points("00_setup.ipynb", _read("00_setup.ipynb").cells)
    assert points and all(first == again for first, again in points.items())
    assert sum(len(restart_points(n, _read(n).cells)) for n in NOTEBOOKS) > len(NOTEBOOKS)


def test_the_cells_a_notebook_says_to_rerun_follow_its_restart():
    name = "05_ddp_training.ipynb"
    out = with_restarts(_read(name), name)
    first = next(i for i, c in enumerate(out.cells) if c.metadata.get("ddplab", {})
                 .get("restart_before") == "cell-20")
    assert out.cells[first + 1].metadata["ddplab"]["rerun_of"] == RESTART_FROM[name]["cell-20"]
    name = "04_sampler_sharding.ipynb"
    out = with_restarts(_read(name), name)
    first = next(i for i, c in enumerate(out.cells) if c.metadata.get("ddplab", {}).get("restart_before"))
    reruns = [c.metadata["ddplab"]["rerun_of"] for c in out.cells[first + 1:first + 4]]
    assert reruns == AFTER_RESTART[name]


def test_failures_names_a_cell_that_raised_and_forgives_one_that_raises_on_purpose():
    nb = nbformat.v4.new_notebook()
    error = nbformat.v4.new_output("error", ename="NameError", evalue="name 'model' is not defined",
                                   traceback=[])
    broken = nbformat.v4.new_code_cell("model.step()", id="cell-09")
    broken.outputs = [error]
    lesson = nbformat.v4.new_code_cell("1/0", id="cell-10", metadata={"tags": ["raises-exception"]})
    lesson.outputs = [error]
    nb.cells = [nbformat.v4.new_markdown_cell("## Training", id="h"), broken, lesson]
    assert failures(nb) == ["cell cell-09 in section '## Training': NameError: name 'model' "
                            "is not defined"]
    broken.outputs = []
    assert failures(nb) == []
