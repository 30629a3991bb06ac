"""The grader's own check (``ddplab.grade.witness``): which check cells it runs, what it
unpickles, and that a check it runs reads the ranks, whatever the kernel patched."""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import json
import pickle
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch

import ddplab
import ddplab.check
from ddplab import procs
from ddplab.grade import unpickle, witness
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
    ("ddplab.check.swap_tensors(swap)", True),             # the student's function: sealed
    ("ddplab.check.who_waited((1, 'recv'))", True),
    ("ddplab.check.global_rank(global_rank, two_nodes)", True),
    ("ddplab.check.bf16_hook()", True),                   # traces: the worker's lab traces too
    ("ddplab.check.zero_bytes(lambda *a: 0)", False),     # code in the cell itself
    ("ddplab.check.who_waited(waited[0])", False),        # would run the notebook's __getitem__
    ("assert ring(3) == 9", False),                       # an instructor's own check
    ("x = ddplab.check.mean_score()", False),
    ("print('Correct')", False),
    ("ddplab.check.mean_score(", False),
])
def test_which_check_cells_the_grader_runs_itself(source, expected):
    assert witness.witnessable(source) is expected


def test_the_grader_runs_every_shipped_check_itself():
    cells = _check_cells()
    assert len(cells) >= 57
    assert [c for c in cells if not witness.witnessable(c)] == []


def test_it_asks_the_kernel_for_the_names_and_for_the_trace_only_for_a_timeline_checker():
    assert witness.asked("ddplab.check.global_rank(global_rank, two_nodes)") == \
        (["global_rank", "two_nodes"], False)
    assert witness.asked("ddplab.check.mean_score(lab)") == ([], False)
    assert witness.asked("ddplab.check.who_waited((1, op))") == (["op"], True)


def test_the_unpickler_takes_plain_data_and_tensors():
    value = {"ok": True, "events": [("stdout", "hi\n")], "error": None,
             "value": [torch.arange(3.0), collections.OrderedDict(w=torch.ones(2, 2)),
                       torch.float16, torch.Size([2]), {1, 2}, b"x", 1.5, None]}
    got = unpickle.SafePickle.loads(pickle.dumps(value))
    assert got["events"] == value["events"]
    assert torch.equal(got["value"][0], value["value"][0])
    assert torch.equal(got["value"][1]["w"], value["value"][1]["w"])
    assert got["value"][2:] == value["value"][2:]


class _Gadget:
    def __reduce__(self):
        return (exec, ("import builtins; builtins.ddplab_pwned = True",))


@pytest.mark.parametrize("value", [_Gadget(), {"value": [_Gadget()]}, print])
def test_the_unpickler_refuses_anything_else_without_running_it(value):
    got = unpickle.SafePickle.loads(pickle.dumps(value))
    assert isinstance(got, unpickle.Refused) and "does not unpickle" in got
    import builtins
    assert not hasattr(builtins, "ddplab_pwned")
    with pytest.raises(pickle.UnpicklingError):
        unpickle.SafeUnpickler(io.BytesIO(pickle.dumps(value))).load()


def _swap(t):
    import torch
    import torch.distributed as dist
    other = 1 - dist.get_rank()
    received = torch.empty_like(t)
    for request in [dist.isend(t, dst=other), dist.irecv(received, src=other)]:
        request.wait()
    return received


def test_the_notebooks_code_stays_sealed_and_goes_back_as_the_kernels_bytes():
    """A function (or a gadget) from the kernel is never unpickled in the worker; pickled again,
    it is the kernel's bytes, for the rank to load."""
    sealed = unpickle.load_name("swap", ("pickle", cloudpickle.dumps(_swap), "_swap"))
    assert isinstance(sealed, unpickle.Sealed) and sealed.__name__ == "_swap"
    assert callable(sealed) and repr(sealed) == "<_swap from the notebook>"
    with pytest.raises(TypeError, match="never runs in its own process"):
        sealed(torch.ones(1))
    assert pickle.loads(pickle.dumps(sealed)).__code__.co_name == "_swap"     # on a rank: the code

    gadget = unpickle.load_name("swap", ("pickle", pickle.dumps(_Gadget()), "swap"))
    import builtins
    assert isinstance(gadget, unpickle.Sealed) and not hasattr(builtins, "ddplab_pwned")


def test_plain_answers_load_as_data_and_ddplabs_records_by_their_class():
    from ddplab.launch import Launch
    assert unpickle.load_name("w", ("pickle", cloudpickle.dumps((1, "recv")), "w")) == (1, "recv")
    launch = Launch([["torchrun"]], [0], False, "", {}, {0: {"RANK": "0"}})
    fields = {f: getattr(launch, f) for f in Launch.__dataclass_fields__}
    kind = type(launch).__module__ + "." + type(launch).__qualname__    # as witness.ASK names it
    got = unpickle.load_name("two_nodes", ("record", kind, cloudpickle.dumps(fields)))
    assert got == launch and type(got) is Launch
    for bad in [("record", "ddplab.trace.Trace", cloudpickle.dumps({})),      # not a record
                ("record", kind, cloudpickle.dumps({"output_by_rank": 1})),
                ("record", "ddplab.launch.Launch", cloudpickle.dumps(fields)),     # an old name
                ("unreadable", "TypeError: cannot pickle '_thread.lock' object"), "nonsense"]:
        with pytest.raises(AssertionError, match="could not read `two_nodes`"):
            unpickle.load_name("two_nodes", bad)


class _Shell:
    def __init__(self, user_ns):
        self.user_ns = user_ns


def _asked_in_a_kernel(source: str, user_ns: dict) -> dict:
    """Run the grader's question for ``source`` as the kernel would; what the worker reads back."""
    printed = io.StringIO()
    user_ns["get_ipython"] = lambda: _Shell(user_ns)
    with contextlib.redirect_stdout(printed):
        exec(witness.ask(source), user_ns)
    return witness.answer([{"output_type": "stream", "name": "stdout",
                                  "text": printed.getvalue()}])


def test_the_kernels_answer_carries_the_names_and_its_last_trace(fresh_lab):
    from ddplab import trace as tracing
    with fresh_lab.trace() as tr:
        fresh_lab.run(tracing.uneven_work, {0: 0.3, 1: 0.0})
    found = _asked_in_a_kernel("ddplab.check.straggler(answer)", {"answer": 0, "other": 1})
    assert found["where"] == fresh_lab.directory and list(found["names"]) == ["answer"]
    assert unpickle.load_name("answer", found["names"]["answer"]) == 0
    copy = unpickle.load_trace(found["trace"])
    assert copy.straggler() == tr.straggler() == 0 and copy.ranks == [0, 1]
    assert [vars(e) for e in copy.events] == [vars(e) for e in tr.events]
    assert _asked_in_a_kernel("ddplab.check.mean_score()", {})["trace"] is None


def test_the_lab_answer_is_read_from_a_line_split_across_messages():
    """On a busy machine one printed line can come in several stream messages."""
    def stream(text):
        return {"output_type": "stream", "name": "stdout", "text": text}
    line = "ddplab-answer: " + base64.b64encode(pickle.dumps(
        {"where": "/tmp/ddplab-x1", "names": {}, "trace": None})).decode() + "\n"
    split = [stream(line[:9]), stream(line[9:30]), stream(line[30:])]
    assert witness.answer(split)["where"] == "/tmp/ddplab-x1"
    gadget = base64.b64encode(pickle.dumps(_Gadget())).decode()
    assert witness.answer([stream(f"ddplab-answer: {gadget}\n")]) is None
    assert witness.answer([stream("ddplab-answer: [1]\n"), stream("noise\n")]) is None
    assert witness.answer([]) is None


def _where(lab, **names) -> dict:
    """What a kernel whose lab is ``lab`` answers the grader, with ``names`` as it pickles them."""
    return {"where": lab.directory, "trace": None,
            "names": {k: ("pickle", cloudpickle.dumps(v), k) for k, v in names.items()}}


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


@pytest.mark.slow           # a kernel and a lab of its own, graded: seconds
@pytest.mark.timeout(300)
def test_a_check_it_runs_reads_the_ranks_whatever_the_kernel_patched(monkeypatch, tmp_path):
    import ipyparallel.serialize.serialize as serialize
    lab = ddplab.start(world_size=2, timeout=120)
    try:
        every = torch.arange(1.0, 3.0).sum() + torch.arange(1.0, 5.0).sum()
        lab.run(_set, "mean_score", (every / 6).reshape(1))
        # the kernel's lab lies, as a submission's would: the grader does not ask it (here the
        # kernel's lab object; a submission can patch the class too, in its kernel, which is
        # not the worker's process, so the worker's own Lab is untouched)
        monkeypatch.setattr(lab, "run", lambda fn, *a, **k: [torch.tensor([0.0])] * 2)
        monkeypatch.setattr(serialize, "pickle", unpickle.SafePickle)
        outputs, error, broke = witness.check("ddplab.check.mean_score()", _where(lab), 60,
                                                    str(tmp_path))
        assert error is None and not broke, error
        assert outputs[0]["text"].startswith("Correct: every rank holds the mean of all 6 scores")
        assert current_lab.current_or_none() is lab              # the kernel's lab stays current

        monkeypatch.undo()                   # the lab's own run again: leave a wrong answer
        monkeypatch.setattr(serialize, "pickle", unpickle.SafePickle)
        lab.run(_set, "mean_score", torch.tensor([0.0]))
        outputs, error, broke = witness.check("ddplab.check.mean_score()", _where(lab), 60)
        assert error is not None and error[0] == "Feedback" and "is wrong" in error[1]

        monkeypatch.undo()
        lab.run(_plant_gadget)
        same = ddplab.check._core.same
        monkeypatch.setattr(serialize, "pickle", unpickle.SafePickle)
        outputs, error, broke = witness.check("ddplab.check.mean_score()", _where(lab), 60)
        assert error is not None and "does not unpickle" in error[1], error
        assert ddplab.check._core.same is same                   # the gadget never ran
    finally:
        monkeypatch.undo()
        lab.stop()


def _say_rank(greeting):
    import torch.distributed as dist
    print(f"{greeting} from rank {dist.get_rank()}")
    return dist.get_rank()


def _fail_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank 1 says no")
    return "fine"


def _spawned(rank, base):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return (rank, t.item())


@pytest.mark.slow           # a kernel and a lab of its own, graded: seconds
@pytest.mark.timeout(300)
def test_the_grader_drives_the_ranks_through_a_plain_lab_that_never_owns_them(capsys):
    """``attach``: a ``Lab`` over the live engines of a lab someone else started, numbered by
    rank; run, output, errors, spawn and trace as on any lab; it forms no group, starts and
    stops no process."""
    from ddplab import trace as tracing
    from ddplab.errors import RankError
    from ddplab.lab import attached
    from ddplab.lab.lab import Lab
    lab = ddplab.start(world_size=2, timeout=120)
    pids = lab.pids
    try:
        mine = attached.lab_at(lab.directory, 60)
        try:
            assert type(mine) is Lab and isinstance(mine.engines, attached.AttachedRanks)
            assert (mine.world_size, mine.ranks, mine.running) == (2, [0, 1], True)
            capsys.readouterr()
            assert mine.run(_say_rank, "hello") == [0, 1]                  # results by rank
            assert mine.run(_say_rank, "hi", ranks=[1]) == {1: 1}
            assert capsys.readouterr().out == ("[rank 0]\nhello from rank 0\n[rank 1]\nhello from "
                                               "rank 1\n[rank 1]\nhi from rank 1\n")
            with pytest.raises(RankError, match="rank 1 says no") as raised:
                mine.run(_fail_on_rank_1)
            assert raised.value.failures.keys() == {1}
            assert mine.spawn(_spawned, args=(10,)) == [(0, 21), (1, 21)]   # its own group, aside
            with mine.trace() as tr:
                mine.run(tracing.uneven_work, {0: 0.0, 1: 0.3})
            assert tr.straggler() == 1 and tracing.last() is tr
        finally:
            mine.stop()
        assert not mine.running
        # The lab it attached to is untouched: same processes, its group still formed.
        assert lab.pids == pids and all(procs.alive(procs.process(pid)) for pid in pids)
        assert lab.healthy and lab.run(_say_rank, "again") == [0, 1]
    finally:
        lab.stop()


@pytest.mark.timeout(300)
def test_attaching_where_there_is_no_lab_says_so(tmp_path):
    from ddplab.lab import attached
    with pytest.raises(AssertionError, match="found no running lab"):
        attached.lab_at(str(tmp_path), 10)


@pytest.mark.slow           # a kernel and a lab of its own, graded: seconds
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
        monkeypatch.setattr(serialize, "pickle", unpickle.SafePickle)
        outputs, error, broke = witness.check("ddplab.check.mean_score()", _where(lab), 60,
                                                    str(tmp_path))
        assert error is None and not broke, error
        assert outputs[0]["text"].startswith("Correct: every rank holds the mean of all 6 scores")
    finally:
        monkeypatch.undo()
        lab.stop()


SWAP = """
def swap(t):
    other = 1 - dist.get_rank()
    received = torch.empty_like(t)
    for request in [dist.isend(t, dst=other), dist.irecv(received, src=other)]:
        request.wait()
    return received
"""
STUB = "def swap(t):\n    raise NotImplementedError()"
DEMO = """
def all_reduce_demo(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()
"""


def _notebook(source: str, name: str):
    """``name`` as a notebook defines it: in ``__main__``, so cloudpickle sends it by value."""
    import torch.distributed as dist
    namespace = {"__name__": "__main__", "torch": torch, "dist": dist}
    exec(source, namespace)
    return namespace[name]


@pytest.mark.slow           # a kernel and a lab of its own, graded: seconds
@pytest.mark.timeout(300)
def test_a_check_given_the_notebooks_function_runs_it_on_the_ranks_only(monkeypatch, tmp_path):
    """The function goes to the ranks sealed; the kernel's patched Lab is not asked; spawn and
    trace work on the worker's own lab."""
    import ipyparallel.serialize.serialize as serialize

    from ddplab import trace as tracing
    from ddplab.lab import attached as attaching
    lab = ddplab.start(world_size=2, timeout=120)
    try:
        monkeypatch.setattr(lab, "run", lambda fn, *a, **k: [torch.tensor([0.0])] * 2)
        monkeypatch.setattr(serialize, "pickle", unpickle.SafePickle)
        run = lambda source, **names: witness.check(source, _where(lab, **names), 60)  # noqa: E731
        outputs, error, broke = run("ddplab.check.swap_tensors(swap)", swap=_notebook(SWAP, "swap"))
        assert error is None and not broke, error
        assert outputs[0]["text"] == "Correct: each rank returned the other rank's tensor and kept its own.\n"
        _, error, _ = run("ddplab.check.swap_tensors(swap)", swap=_notebook(STUB, "swap"))
        assert error[0] == "Feedback" and error[1].startswith("NotImplementedError"), error
        outputs, error, _ = run("ddplab.check.own_group_demo(demo)", demo=_notebook(DEMO, "all_reduce_demo"))
        assert error is None and outputs[0]["text"].startswith("Correct: lab.spawn ran your function"), error

        attached = attaching.lab_at(lab.directory, 60)
        try:
            with attached.trace() as tr:
                attached.run(tracing.uneven_work, {0: 0.0, 1: 0.3})
            assert tr.straggler() == 1 and tracing.last() is tr
        finally:
            attached.stop()
    finally:
        monkeypatch.undo()
        lab.stop()


@pytest.mark.slow           # a kernel and a lab of its own, graded: seconds
@pytest.mark.timeout(300)
def test_a_check_cell_it_cannot_run_itself_runs_in_the_kernel_and_the_grader_says_so(
        tmp_path, caplog):
    """An instructor's own ``assert`` runs guarded in the kernel (forgeable): a warning names it."""
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    from ddplab.grade.class_run import grade
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [new_code_cell("### BEGIN SOLUTION\nx = 3\n### END SOLUTION", id="exercise-x",
                              metadata={"tags": ["exercise"]}),
                new_code_cell("assert x * x == 9\nprint('Correct: x squared is 9.')", id="check-x",
                              metadata={"tags": ["check"]},
                              outputs=[new_output("stream", name="stdout",
                                                  text="Correct: x squared is 9.\n")])]
    reference = tmp_path / "course" / "00_x.ipynb"
    reference.parent.mkdir()
    nbformat.write(nb, reference)
    for student, answer in (("right", "x = 3"), ("wrong", "x = 4")):
        (tmp_path / student).mkdir()
        nb.cells[0].source = answer
        nbformat.write(nb, tmp_path / student / "00_x.ipynb")
    with caplog.at_level("WARNING", logger="ddplab.grade.class_run"):
        graded = {g.student: g.score for g in grade([tmp_path / "right", tmp_path / "wrong"],
                                                    reference, jobs=2, cell_timeout=120)}
    assert graded == {"right": 1, "wrong": 0}
    warned = [r.getMessage() for r in caplog.records if "check-x" in r.getMessage()]
    assert len(warned) == 1 and "can forge it" in warned[0] and "00_x.ipynb" in warned[0], warned
    assert "docs/instructors.md" in warned[0], warned
