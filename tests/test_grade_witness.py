"""The grader's own check (``ddplab.course.grade_witness``): which check cells it runs, what it
unpickles, and that a check it runs reads the ranks, whatever the kernel patched."""

from __future__ import annotations

import collections
import inspect
import io
import json
import pickle
from pathlib import Path

import pytest
import torch

import ddplab
import ddplab.check
from ddplab.course import grade_witness
from ddplab.lab import current_lab

ROOT = Path(__file__).resolve().parent.parent


def _check_cells() -> list[str]:
    cells = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if "check" in cell.get("metadata", {}).get("tags", []):
                cells.append("".join(cell["source"]))
    return cells


@pytest.mark.parametrize("source, expected", [
    ("ddplab.check.mean_score()", True),
    ("ddplab.check.mean_score(lab)", True),
    ("ddplab.check.swap_tensors(swap)", False),            # the student's function, in the kernel
    ("ddplab.check.who_waited((1, 'recv'))", True),
    ("ddplab.check.bf16_hook()", False),                  # traces: KERNEL_ONLY
    ("print('Correct')", False),
    ("ddplab.check.mean_score(", False),
])
def test_which_check_cells_the_grader_runs_itself(source, expected):
    assert grade_witness.witnessable(source) is expected


def test_the_checkers_it_runs_need_only_run_and_world_size_of_the_lab():
    """A checker that traces or spawns needs the kernel's lab: it must be in KERNEL_ONLY."""
    witnessed = [c for c in _check_cells() if grade_witness.witnessable(c)]
    assert len(witnessed) >= 20, witnessed
    for cell in witnessed:
        name = cell.split("ddplab.check.", 1)[1].split("(", 1)[0]
        source = inspect.getsource(getattr(ddplab.check, name))
        assert "lab.trace" not in source and "lab.spawn" not in source, name
    for name in grade_witness.KERNEL_ONLY:
        assert "lab.trace" in inspect.getsource(getattr(ddplab.check, name)), name


def test_the_unpickler_takes_plain_data_and_tensors():
    value = {"ok": True, "events": [("stdout", "hi\n")], "error": None,
             "value": [torch.arange(3.0), collections.OrderedDict(w=torch.ones(2, 2)),
                       torch.float16, torch.Size([2]), {1, 2}, b"x", 1.5, None]}
    got = grade_witness._SafePickle.loads(pickle.dumps(value))
    assert got["events"] == value["events"]
    assert torch.equal(got["value"][0], value["value"][0])
    assert torch.equal(got["value"][1]["w"], value["value"][1]["w"])
    assert got["value"][2:] == value["value"][2:]


class _Gadget:
    def __reduce__(self):
        return (exec, ("import builtins; builtins.ddplab_pwned = True",))


@pytest.mark.parametrize("value", [_Gadget(), {"value": [_Gadget()]}, print])
def test_the_unpickler_refuses_anything_else_without_running_it(value):
    got = grade_witness._SafePickle.loads(pickle.dumps(value))
    assert isinstance(got, grade_witness.Refused) and "does not unpickle" in got
    import builtins
    assert not hasattr(builtins, "ddplab_pwned")
    with pytest.raises(pickle.UnpicklingError):
        grade_witness.SafeUnpickler(io.BytesIO(pickle.dumps(value))).load()


def _set(name, value):
    from ddplab.rank.engine import namespace
    namespace()[name] = value


def _plant_gadget():
    """On a rank: ``mean_score`` whose unpickling, where a check reads it, would make every
    comparison pass."""
    from ddplab.rank.engine import namespace

    class Forge:
        def __reduce__(self):
            return (exec, ("import ddplab.check._core as c; c.same = lambda *a, **k: True",))
    namespace()["mean_score"] = Forge()


@pytest.mark.timeout(300)
def test_a_check_it_runs_reads_the_ranks_whatever_the_kernel_patched(monkeypatch, tmp_path):
    import ipyparallel.serialize.serialize as serialize
    lab = ddplab.start(world_size=2, timeout=120)
    try:
        every = torch.arange(1.0, 3.0).sum() + torch.arange(1.0, 5.0).sum()
        lab.run(_set, "mean_score", (every / 6).reshape(1))
        # the kernel's Lab lies, as a submission's would: the grader does not ask it
        monkeypatch.setattr(type(lab), "run", lambda self, fn, *a, **k: [torch.tensor([0.0])] * 2)
        monkeypatch.setattr(serialize, "pickle", grade_witness._SafePickle)
        outputs, error, broke = grade_witness.check("ddplab.check.mean_score()", lab.directory, 60,
                                                    str(tmp_path))
        assert error is None and not broke, error
        assert outputs[0]["text"].startswith("Correct: every rank holds the mean of all 6 scores")
        assert current_lab.current_or_none() is lab              # the kernel's lab stays current

        monkeypatch.undo()                   # the lab's own run again: leave a wrong answer
        monkeypatch.setattr(serialize, "pickle", grade_witness._SafePickle)
        lab.run(_set, "mean_score", torch.tensor([0.0]))
        outputs, error, broke = grade_witness.check("ddplab.check.mean_score()", lab.directory, 60)
        assert error is not None and error[0] == "AssertionError" and "is wrong" in error[1]

        monkeypatch.undo()
        lab.run(_plant_gadget)
        same = ddplab.check._core.same
        monkeypatch.setattr(serialize, "pickle", grade_witness._SafePickle)
        outputs, error, broke = grade_witness.check("ddplab.check.mean_score()", lab.directory, 60)
        assert error is not None and "does not unpickle" in error[1], error
        assert ddplab.check._core.same is same                   # the gadget never ran
    finally:
        monkeypatch.undo()
        lab.stop()


@pytest.mark.timeout(300)
def test_a_check_right_after_a_restart_reads_the_new_ranks(monkeypatch, tmp_path):
    """The hub lists the killed engines for a few heartbeats after ``lab.restart()``.

    Notebook 09's checks come right after a hang demo and its restart: the
    grader's own handle must take the live engines only (it failed the
    reference's checks with ``EngineError: Engine 0 died``).
    """
    import ipyparallel.serialize.serialize as serialize
    lab = ddplab.start(world_size=2, timeout=120)
    try:
        lab.restart()
        every = torch.arange(1.0, 3.0).sum() + torch.arange(1.0, 5.0).sum()
        lab.run(_set, "mean_score", (every / 6).reshape(1))
        monkeypatch.setattr(serialize, "pickle", grade_witness._SafePickle)
        outputs, error, broke = grade_witness.check("ddplab.check.mean_score()", lab.directory, 60,
                                                    str(tmp_path))
        assert error is None and not broke, error
        assert outputs[0]["text"].startswith("Correct: every rank holds the mean of all 6 scores")
    finally:
        monkeypatch.undo()
        lab.stop()


def test_the_lab_directory_is_read_from_a_line_split_across_messages():
    """On a busy machine one printed line can come in several stream messages."""
    def stream(text):
        return {"output_type": "stream", "name": "stdout", "text": text}
    split = [stream("ddplab-where:"), stream(' "/tmp/ddplab-'), stream('x1"\n')]
    assert grade_witness.where(split) == "/tmp/ddplab-x1"
    assert grade_witness.where([stream('ddplab-where: ""\n')]) == ""
    assert grade_witness.where([stream("ddplab-where: [1]\n"), stream("noise\n")]) == ""
    assert grade_witness.where([]) == ""
