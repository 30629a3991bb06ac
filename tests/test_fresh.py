"""Fresh code on the ranks (``ddplab.rank.fresh``): the user's own modules, edited on disk, on real labs.

The rule under test (docs/students.md, "Editing your own modules"): before each
job (a ``%%ranks`` cell, ``lab.run``, ``lab.spawn``, ``lab.run_script``) every
rank reloads the user's modules whose files changed, never during a job; their
functions and classes travel by name, so on a rank they are the objects
``sys.modules`` names there, and torch's RPC, which pickles functions by
reference, finds the very same objects (issue 63). Each module is written to a
tmp folder and edited between calls; names are unique because the session's
ranks outlive each test.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from conftest import cell_error

import ddplab


# ------------------------------------------------------------------ helpers
def _path_insert(folder: str) -> None:
    import sys
    sys.path.insert(0, folder)


def _path_remove(folder: str) -> None:
    import sys
    while folder in sys.path:
        sys.path.remove(folder)


@contextlib.contextmanager
def on_path(lab, folder: Path):
    """``folder`` on the kernel's path and each rank's, as the notebook's own folder is."""
    sys.path.insert(0, str(folder))
    lab.run(_path_insert, str(folder))
    try:
        yield folder
    finally:
        lab.run(_path_remove, str(folder))
        _path_remove(str(folder))


@pytest.fixture
def own(tmp_path, fresh_lab):
    with on_path(fresh_lab, tmp_path):
        yield tmp_path


def write(folder: Path, source: str, name: str | None = None) -> str:
    """Write ``source`` as a module in ``folder``; its name (new and unique unless given)."""
    name = name or f"own_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def printed(capsys) -> str:
    return capsys.readouterr().out


def both(text: str) -> str:
    return f"[rank 0]\n{text}\n[rank 1]\n{text}\n"


# ------------------------------------------------------------------ cells and lab.run
def test_a_cell_and_lab_run_agree_after_every_edit(shell, fresh_lab, own, capsys):
    """Issue 58's case: the same rank answered 1, then 2 (lab.run), then 1 (the cell)."""
    name = write(own, "def f():\n    return 1\n")
    assert cell_error(shell, f"%%ranks\nimport {name}\nprint({name}.f())") is None
    assert printed(capsys) == both("1")
    write(own, "def f():\n    return 2\n", name)       # the same size, a moment later
    module = importlib.import_module(name)               # the kernel imports the edited file
    assert fresh_lab.run(module.f) == [2, 2]
    assert cell_error(shell, f"%%ranks\nprint({name}.f())") is None
    assert printed(capsys) == both("2")                  # before: 1, the rank's first import
    write(own, "def f():\n    return 'three'\n", name)  # edited, not reloaded in the kernel
    assert fresh_lab.run(module.f) == ["three", "three"]  # the file as it is now, as a new process
    assert cell_error(shell, f"%%ranks\nprint({name}.f())") is None
    assert printed(capsys) == both("three")


def test_a_function_added_to_the_file_is_there_in_the_next_cell(shell, fresh_lab, own, capsys):
    name = write(own, "def f():\n    return 1\n")
    assert cell_error(shell, f"%%ranks\nimport {name}") is None
    write(own, "def f():\n    return 1\n\ndef g():\n    return 'new'\n", name)
    assert cell_error(shell, f"%%ranks\nprint({name}.g())") is None   # before: AttributeError
    assert printed(capsys) == both("new")


def test_names_taken_from_an_edited_module_follow_it(shell, fresh_lab, own, capsys):
    """``from mod import f`` in a cell, or in another of the user's modules, sees the new ``f``."""
    name = write(own, "def f():\n    return 'old'\n")
    helper = write(own, f"from {name} import f\n\ndef g():\n    return 'via helper ' + f()\n")
    assert cell_error(shell, f"%%ranks\nfrom {name} import f\nimport {helper}") is None
    write(own, "def f():\n    return 'new, edited'\n", name)
    assert cell_error(shell, f"%%ranks\nprint(f(), '/', {helper}.g())") is None
    assert printed(capsys) == both("new, edited / via helper new, edited")


def test_an_edit_that_breaks_the_module_stops_the_job_and_says_which(shell, fresh_lab, own, capsys):
    name = write(own, "def f():\n    return 1\n")
    assert cell_error(shell, f"%%ranks\nimport {name}") is None
    write(own, "def f(:\n    return 2\n", name)
    error = cell_error(shell, f"%%ranks\nprint('this cell ran')\nprint({name}.f())")
    assert isinstance(error, ddplab.RankError) and set(error.failures) == {0, 1}
    message = error.failures[0]
    assert f"module {name} changed on disk" in message and "SyntaxError" in message, message
    assert "did not run" in message and "fresh.py" not in message, message
    assert "this cell ran" not in printed(capsys)                # not a line of it ran, with old code or new
    write(own, "def f():\n    return 'fixed'\n", name)
    assert cell_error(shell, f"%%ranks\nprint({name}.f())") is None
    assert printed(capsys).endswith(both("fixed"))


def test_lab_run_of_a_function_the_file_no_longer_has_names_the_fix(fresh_lab, own):
    name = write(own, "def f():\n    return 1\n\ndef gone():\n    return 2\n")
    module = importlib.import_module(name)
    write(own, "def f():\n    return 1\n", name)    # saved without gone(); the kernel still has it
    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.run(module.gone)
    message = info.value.failures[0]
    assert "defines no gone" in message and f"importlib.reload({name})" in message, message


def test_lab_run_of_a_module_the_ranks_cannot_import_says_why(fresh_lab, own):
    """As under ``torch.multiprocessing.spawn``: the module travels by name, each rank imports it."""
    name = write(own, "def f():\n    return 1\n")
    module = importlib.import_module(name)
    (own / f"{name}.py").unlink()                       # as on a host that lacks the file
    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.run(module.f)
    message = info.value.failures[1]
    assert f"rank 1 cannot import {name}" in message and "travel by name" in message, message


def test_a_module_the_kernel_found_after_the_lab_started_is_found_on_the_ranks(shell, fresh_lab,
                                                                                   tmp_path, capsys):
    """The ranks look where the kernel looks now, not only where it looked at ``ddplab.start``."""
    name = write(tmp_path, "def f():\n    return 'found'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert fresh_lab.run(importlib.import_module(name).f) == ["found", "found"]
        assert cell_error(shell, f"%%ranks\nimport {name}\nprint({name}.f())") is None
        assert printed(capsys) == both("found")
    finally:
        _path_remove(str(tmp_path))


# ------------------------------------------------------------------ spawn and run_script
CLASS_MODULE = """
    import sys

    class Config:
        def __init__(self, size):
            self.size = size

    def check(rank, config):
        here = sys.modules[__name__]          # what pickle and torch.save look up by name
        return [check is here.check, type(config) is here.Config, config.size]
"""


def test_a_users_function_and_class_are_what_their_module_names_on_the_rank(fresh_lab, own):
    """A spawned function and an argument of the user's own class are the objects
    ``sys.modules`` names on the rank. Before: copies, by value, that no name leads to."""
    module = importlib.import_module(write(own, CLASS_MODULE))
    assert fresh_lab.spawn(module.check, args=(module.Config(3),)) == [[True, True, 3]] * 2
    assert fresh_lab.run(module.check, 0, module.Config(4)) == [[True, True, 4]] * 2


def test_run_script_uses_an_edited_module_from_outside_its_folder(fresh_lab, own, tmp_path_factory,
                                                                   capsys):
    """``run_script`` already imports its own folder afresh; a module on the path is fresh too."""
    name = write(own, "VALUE = 'first'\n")
    script = tmp_path_factory.mktemp("script") / "train.py"
    script.write_text(f"import {name}\nprint('value', {name}.VALUE)\n")
    fresh_lab.run_script(str(script))
    write(own, "VALUE = 'second, edited'\n", name)
    fresh_lab.run_script(str(script))
    lines = [line for line in printed(capsys).splitlines() if line.startswith("value")]
    assert lines == ["value first"] * 2 + ["value second, edited"] * 2, lines


# ------------------------------------------------------------------ RPC: functions by reference
RPC_MODULE = """
    import torch.distributed.rpc as rpc

    def answer(x):
        return ({tag!r}, x + {add})

    def worker(rank, world_size):
        rpc.init_rpc(f"w{{rank}}", rank=rank, world_size=world_size)
        got = None
        if rank == 0:    # rpc_async pickles answer by reference: by name, looked up on both sides
            futs = [rpc.rpc_async(f"w{{peer}}", answer, args=(peer,)) for peer in range(1, world_size)]
            got = [fut.wait() for fut in futs]
        rpc.shutdown()
        return got
"""


def test_an_rpc_module_edited_between_spawns_runs_as_edited_by_reference(fresh_lab4, tmp_path):
    """Issue 63: ``rpc.rpc_async(..., answer)`` from a function ``lab.spawn`` ran. Before: "Can't
    pickle <function answer>: it's not the same object as own_....answer"."""
    with on_path(fresh_lab4, tmp_path):
        name = write(tmp_path, RPC_MODULE.format(tag="one", add=1))
        module = importlib.import_module(name)
        assert fresh_lab4.spawn(module.worker, args=(4,)) == [
            [("one", 2), ("one", 3), ("one", 4)], None, None, None]
        write(tmp_path, RPC_MODULE.format(tag="two, edited", add=10), name)   # not reloaded here
        assert fresh_lab4.spawn(module.worker, args=(4,))[0] == [
            ("two, edited", 11), ("two, edited", 12), ("two, edited", 13)]
        write(tmp_path, RPC_MODULE.format(tag="three", add=100), name)
        importlib.reload(module)                                           # as %autoreload does
        assert fresh_lab4.spawn(module.worker, args=(4,), nprocs=4, join=True)[0] == [
            ("three", 101), ("three", 102), ("three", 103)]


@pytest.mark.slow
def test_rpc_with_a_ddp_subgroup_and_a_remote_module_runs_through_spawn(fresh_lab4):
    """pytorch/examples' ddp_rpc pattern (our own program, ``tests/hybrid_rpc.py``) on 4 ranks.

    On fresh ranks, as after ``ddplab.start``: torch binds RRef bookkeeping (``RRefContext``, a
    per-process singleton) to a process's first RPC agent, so RRefs (``RemoteModule``) in a later
    RPC run of the same process hang at shutdown; the ranks of this lab may have run RPC before.
    """
    import hybrid_rpc

    fresh_lab4.restart()
    reports = fresh_lab4.spawn(hybrid_rpc.run_worker, args=(4,), nprocs=4, join=True)
    assert reports[0] is None and reports[1] is None and reports[3] is None
    master = reports[hybrid_rpc.MASTER]
    first, second = master["trainers"]
    assert first["same_object"] and second["same_object"]
    for name, tensor in first["fc"].items():                 # DDP kept the dense part in step
        torch.testing.assert_close(second["fc"][name], tensor)
    torch.manual_seed(0)
    start = torch.nn.Linear(hybrid_rpc.EMBEDDING_DIM, hybrid_rpc.CLASSES).state_dict()
    assert not torch.equal(first["fc"]["weight"], start["weight"])       # and it trained
    assert not torch.equal(master["before"], master["after"])           # so did the remote table
    assert all(len(t["losses"]) == hybrid_rpc.STEPS for t in (first, second))
    assert fresh_lab4.run(lambda: __import__("torch.distributed").distributed.get_world_size()) \
        == [4] * 4                                                       # the lab's group is back


def test_run_script_twice_with_its_own_modules_edited_between(fresh_lab, tmp_path, capsys):
    """The script's folder is on the path only while it runs: its modules, edited after a run,
    are left to ``run_script``, which imports them afresh (a sibling importing a sibling too)."""
    (tmp_path / "helpers.py").write_text("WHO = 'helpers'\n")
    (tmp_path / "model.py").write_text("from helpers import WHO\nNAME = 'first ' + WHO\n")
    script = tmp_path / "train.py"
    script.write_text("import model\nprint('model is', model.NAME)\n")
    fresh_lab.run_script(str(script))
    (tmp_path / "model.py").write_text("from helpers import WHO\nNAME = 'second, edited, ' + WHO\n")
    fresh_lab.run_script(str(script))
    lines = [line for line in printed(capsys).splitlines() if line.startswith("model is")]
    assert lines == ["model is first helpers"] * 2 + ["model is second, edited, helpers"] * 2, lines
