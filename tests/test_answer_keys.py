"""ddplab.check._keys: a checker's reference is loaded by the checker, and by nothing else.

A stand-in key (``standin.py``, a reference answer of one line) is written in a
folder of the test's, which the package is pointed at; a stand-in checker is a
function whose module is named ``ddplab.check.<something>``, as every checker's is.
The student's side is a cell of IPython's shell, and a function run on a lab's ranks.
Then the real keys (``scale``, notebook 15's; ``pipelines``, notebook 13's): the names
they had in the checkers are gone, the keys reach neither a cell nor a rank, no checker
keeps a copy, and each check passes its notebook's solution and words a mistake as it did
before its reference moved.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest
from conftest import fails

import ddplab.check
from ddplab.check import _keys

STANDIN = "def bubble(p, m):\n    return (p - 1) / (m + p - 1)\n"
REFUSED = "is a checker's answer key"


@pytest.fixture
def standin(tmp_path, monkeypatch):
    (tmp_path / "standin.py").write_text(STANDIN)
    monkeypatch.setattr(_keys, "FOLDER", tmp_path)
    return tmp_path


def _checker(source: str, module: str = "ddplab.check.nb99_standin") -> types.FunctionType:
    """A function defined in a module named ``module`` (a checker's name, or a student's)."""
    space = {"__name__": module, "_keys": _keys}
    exec(compile(source, f"<{module}>", "exec"), space)
    return space["check"]


CHECK = "def check(p, m):\n    key = _keys.load('standin')\n    return key.bubble(p, m)\n"


def test_a_checker_loads_the_key_and_nothing_keeps_it(standin):
    assert _checker(CHECK)(4, 12) == 3 / 15
    assert not [name for name in sys.modules if name.startswith("ddplab.check._keys.")]
    assert _keys.names() == ["standin"]


def test_a_student_cannot_import_or_load_the_key(standin):
    for attempt, args in ((importlib.import_module, ("ddplab.check._keys.standin",)),
                          (__import__, ("ddplab.check._keys.standin",)),
                          (_keys.load, ("standin",)),                   # from a test: not a checker
                          (_checker(CHECK, module="__main__"), (4, 12))):   # the checker's code, a cell's
        with pytest.raises(ImportError, match=REFUSED) as raised:
            attempt(*args)
        assert "Compute the answer yourself" in str(raised.value)


def test_with_the_finder_removed_the_import_still_finds_nothing(standin, monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "_Refuse"])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ddplab.check._keys.standin")


def test_a_notebook_cell_is_refused_with_the_rule(shell, standin):
    result = shell.run_cell("from ddplab.check._keys import standin")
    assert isinstance(result.error_in_exec, ImportError) and REFUSED in str(result.error_in_exec)
    result = shell.run_cell("import ddplab.check._keys as k\nk.load('standin')")
    said = str(result.error_in_exec)
    assert REFUSED in said and "from outside ddplab's checkers" in said


def _on_a_rank() -> list[str]:
    """On a rank: import the key, and load it as a checker would (a checker-named module)."""
    from ddplab.check import _keys as keys

    said = []
    try:
        importlib.import_module("ddplab.check._keys.standin")
    except ImportError as e:
        said.append(str(e))
    space = {"__name__": "ddplab.check.nb99_standin", "_keys": keys}
    exec("def check():\n    return _keys.load('standin')\n", space)
    try:
        space["check"]()
    except ImportError as e:
        said.append(str(e))
    return said


def test_on_a_rank_even_a_checker_cannot_load_a_key(fresh_lab):
    for said in fresh_lab.run(_on_a_rank, timeout=60):
        assert len(said) == 2 and all(REFUSED in s for s in said), said
        assert "loading it on a rank" in said[1]


def test_a_sealed_worker_loads_keys_from_memory_and_the_file_is_gone(standin, tmp_path_factory, monkeypatch):
    from ddplab.grade import sandbox

    monkeypatch.setattr(sandbox, "answer_key_sources", lambda: [standin / "standin.py"])
    blob = tmp_path_factory.mktemp("worker") / "keys"
    blob.write_bytes(sandbox.answer_keys_blob())
    monkeypatch.setattr(_keys, "_sealed", {})
    assert _keys.seal(blob) and not blob.exists()
    monkeypatch.setattr(_keys, "FOLDER", tmp_path_factory.mktemp("sandboxed"))   # sources hidden
    assert _checker(CHECK)(2, 2) == 1 / 3
    assert not _keys.seal(blob)                                   # a second look finds nothing


def test_the_sandbox_hides_every_key_and_hands_the_worker_a_file(tmp_path):
    from ddplab.grade import sandbox

    keys = sandbox.answer_key_sources()
    args = sandbox.wrap(["true"], scratch=tmp_path, bwrap="bwrap")
    for source in keys:
        at = args.index(str(source))
        assert args[at - 2:at] == ["--ro-bind", str(tmp_path / "answers" / "empty.py")], source
    at = args.index(sandbox.ANSWER_KEYS_VARIABLE)
    assert args[at - 1] == "--setenv" and args[at + 1] == str(tmp_path / "answer-keys")
    assert (tmp_path / "answer-keys").exists() and _keys.ENV == sandbox.ANSWER_KEYS_VARIABLE
    assert (tmp_path / "answers" / "empty.py").read_text() == ""


def test_a_worker_importing_ddplab_check_seals_the_keys_and_its_children_see_nothing(standin, tmp_path,
                                                                                     monkeypatch):
    """What ``witness.prepare`` does in a grading worker: ``import ddplab.check`` takes the keys,
    deletes their file, and drops the variable, so the kernel it starts next finds neither."""
    import os
    import subprocess

    from ddplab.grade import sandbox

    monkeypatch.setattr(sandbox, "answer_key_sources", lambda: [standin / "standin.py"])
    blob = tmp_path / "answer-keys"
    blob.write_bytes(sandbox.answer_keys_blob())
    probe = PROBE.replace("BLOB", str(blob)).replace("VARIABLE", _keys.ENV)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env={**os.environ, _keys.ENV: str(blob)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['standin'] False None", "None"]     # and a child: nothing


#: A worker's view, then its child's (the kernel it starts).
PROBE = """
import os, subprocess, sys
import ddplab.check
from ddplab.check import _keys
print(sorted(_keys._sealed), os.path.exists("BLOB"), os.environ.get("VARIABLE"))
child = "import os; print(os.environ.get('VARIABLE'))"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
"""


def test_no_checker_keeps_a_key_on_a_module_level_name():
    """``load`` at module level would make the key an attribute of a checker module: importable."""
    root = Path(_keys.__file__).resolve().parent.parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "load" and \
                        getattr(call.func.value, "id", "") in ("_keys", "keys"):
                    found.append(f"{path.relative_to(root)}:{call.lineno}")
    assert found == [], f"module-level answer keys: {found}"


def test_inside_the_sandbox_a_key_is_empty_and_only_the_worker_has_it(tmp_path, monkeypatch):
    """A real bubblewrap sandbox as ``ddplab grade`` makes one: the key's source reads empty
    inside, and the worker's ``import ddplab.check`` has the compiled key and nothing left behind."""
    import subprocess

    from ddplab.grade import sandbox

    if sandbox.unavailable_reason():
        pytest.skip(f"no sandbox here: {sandbox.unavailable_reason()}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    key = scratch / "standin.py"                      # inside a folder the sandbox binds
    key.write_text(STANDIN)
    monkeypatch.setattr(sandbox, "answer_key_sources", lambda: [key])
    probe = ("import os\nprint(repr(open(%r).read()))\nimport ddplab.check\nfrom ddplab.check import _keys\n"
             "print(sorted(_keys._sealed), os.path.exists(%r), os.environ.get(%r))"
             % (str(key), str(scratch / "answer-keys"), _keys.ENV))
    command = sandbox.wrap([sys.executable, "-c", probe], scratch=scratch)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env=sandbox.environment(dict(__import__("os").environ)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["''", "['standin'] False None"], result.stdout
    assert key.read_text() == STANDIN                 # outside, the file is what it was



# ------------------------------------------------ the real keys: notebook 15's and notebook 13's
#: Where each reference lived before it became a key: (module, name, the key now).
MOVED = [("ddplab.check.nb15_at_scale.predictions", name, "scale")
         for name in ("_fits_right", "_fits_by", "_smallest", "_share", "_growth", "_per_op", "_step")] + \
        [("ddplab.check.nb15_at_scale._inputs", "ring", "scale"),
         ("ddplab.check.nb13_build_pipelines.schedules", "_bubble", "pipelines")]


def _reach(module: str, name: str, key: str) -> list[str]:
    """Three ways a cell or a rank reaches for a key: the old name, the key's import, ``load``."""
    said = []
    for attempt in (f"from {module} import {name}", f"import ddplab.check._keys.{key}",
                    f"import ddplab.check._keys as k\nk.load({key!r})"):
        try:
            exec(attempt, {"__name__": "__main__"})
            said.append(f"{attempt}: no error")
        except ImportError as e:
            said.append(str(e))
    return said


@pytest.mark.exercise("predict_step", "bypass")
@pytest.mark.exercise("fits_budget", "bypass")
@pytest.mark.exercise("bubble_microbatches", "bypass")
@pytest.mark.exercise("replay_growth", "bypass")
@pytest.mark.exercise("bubble_fraction", "bypass")
@pytest.mark.parametrize("module, name, key", MOVED)
def test_a_cell_reaches_no_reference_by_its_old_name_or_its_key(shell, module, name, key):
    for line in (f"from {module} import {name}", f"import ddplab.check._keys.{key}",
                 f"from ddplab.check._keys import {key}"):
        result = shell.run_cell(line)
        assert isinstance(result.error_in_exec, ImportError), (line, result.error_in_exec)
    assert REFUSED in str(result.error_in_exec) and "importing it" in str(result.error_in_exec)
    assert not hasattr(importlib.import_module(module), name)


@pytest.mark.exercise("predict_step", "bypass")
@pytest.mark.exercise("fits_budget", "bypass")
@pytest.mark.exercise("bubble_microbatches", "bypass")
@pytest.mark.exercise("replay_growth", "bypass")
@pytest.mark.exercise("bubble_fraction", "bypass")
def test_a_rank_reaches_no_reference_by_its_old_name_or_its_key(fresh_lab):
    for module, name, key in MOVED:
        for said in fresh_lab.run(_reach, module, name, key, timeout=60):
            old, imported, loaded = said
            assert f"cannot import name '{name}'" in old, said
            assert REFUSED in imported and "importing it" in imported, said
            assert REFUSED in loaded and "loading it on a rank" in loaded, said


def _functions(code: types.CodeType, nested: bool = True) -> set[tuple]:
    """The functions in compiled code (``nested``: theirs too, lambdas and generators), by what
    they do: their bytecode and the names they use."""
    found = set()
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.add((const.co_code, const.co_names))
            found |= _functions(const) if nested else set()
    return found


def test_no_checker_module_keeps_a_copy_of_a_key():
    """A key's function copied back into a checker (under any name) would be importable again."""
    root = Path(_keys.__file__).resolve().parent
    assert {"pipelines", "scale"} <= set(_keys.names())
    keys = {p.stem: _functions(compile(p.read_text(), str(p), "exec"), nested=False)
            for p in root.glob("*.py") if p.name != "__init__.py"}
    copies = []
    for path in sorted(root.parent.rglob("*.py")):
        if path.parent != root:
            code = _functions(compile(path.read_text(), str(path), "exec"))
            copies += [f"{path.relative_to(root.parent)} has key {k}'s code" for k, key in keys.items()
                       if key & code]
    assert copies == []


def _notebook_solution(notebook: str, check: str):
    """The reference notebook's own solution of ``check`` (its exercise cell, run)."""
    import nbformat

    path = Path(__file__).resolve().parent.parent / "notebooks" / notebook
    cell = next(c for c in nbformat.read(path, as_version=4).cells
                if c.get("id") == "exercise-" + check.replace("_", "-"))
    space: dict = {}
    exec(cell.source, space)
    return space[f"my_{check}"]


# Wrong answers, each a mistake a check names with a key's help.
def step_whole_tensors(f, r, s, n, a, b):
    return f / r + 2 * (n - 1) * a + 2 * s * b


def fits_without_temporaries(rows, budget):
    fitting = [r for r in rows if r.error is None and sum(r.memory.values()) <= budget]
    return max(fitting, key=lambda r: r.tokens_per_s).strategy if fitting else None


def bubble_at_most(p, batch, target):
    return next((m for m in range(1, batch + 1) if batch % m == 0 and (p - 1) / (m + p - 1) <= target),
                None)


def _per_op(events):
    out = {}
    for e in events:
        out[e.op] = out.get(e.op, 0.0) + e.duration
    return out


def growth_over_the_recording(tr, n, fit):
    big, recorded = _per_op(tr.replay(world_size=n, **fit).on(0)), _per_op(tr.on(0))
    return {op: big[op] - recorded.get(op, 0.0) for op in big}


def bubble_of_forwards(events):
    forwards = [e for e in events if e.op != "backward"]
    start, end = min(e.start for e in forwards), max(e.end for e in forwards)
    return 1 - sum(e.end - e.start for e in forwards) / (len({e.rank for e in forwards}) * (end - start))


#: (check, notebook, a wrong answer, the check's whole message for it before the keys moved).
BEFORE = [
    ("predict_step", "15_at_scale.ipynb", step_whole_tensors,
     "predict_step(6.2e+09, 1.7e+10, 8.4e+06, 2, 9e-05, 5e-10) is wrong: got 0.3732858823529412.\n"
     "Hint: the (N-1)/N factor is missing from the bytes: in a ring each rank sends 2(N-1) pieces of "
     "S/N bytes, not 2 whole tensors."),
    ("fits_budget", "15_at_scale.ipynb", fits_without_temporaries,
     "fits_budget(<rows: ddp, zero1, fsdp, tp8+fsdp, pp4+fsdp>, 20 GB) is wrong: got 'zero1'.\n"
     "Hint: its parameters, gradients, optimizer state and activations fit, but not its peak: "
     "temporaries (gathered shards, the backward's buffers) come on top; compare row.peak."),
    ("bubble_microbatches", "15_at_scale.ipynb", bubble_at_most,
     "bubble_microbatches(4, 540, 0.1) is wrong: got 27.\n"
     "Hint: that makes the bubble *at most* the target, not under it: at exactly the target keep going."),
    ("replay_growth", "15_at_scale.ipynb", growth_over_the_recording,
     "replay_growth(<a 2-rank trace>, 8, alpha=9e-05, beta=5e-10) is wrong: got {'all_reduce': "
     "-0.002288591999999999, 'wait': 0.0023953919999999927}.\nHint: it compares the replay with the "
     "recording: the recorded collectives ran on a loaded machine, slower than the fit says, so the "
     "difference mixes the load with the world size. Replay the trace at its own size too "
     "(len(tr.ranks)) and compare the two replays."),
    ("bubble_fraction", "13_build_pipelines.ipynb", bubble_of_forwards,
     "bubble_fraction of a 1f1b step on 2 stages, 8 micro-batches is wrong: got 0.652173913043478.\n"
     "Hint: it left out the backwards: a backward (op 'backward') is work too."),
]


@pytest.mark.parametrize("check, notebook, wrong, message", BEFORE, ids=[row[0] for row in BEFORE])
def test_a_check_with_its_key_passes_the_notebooks_solution_and_says_what_it_said(
        fresh_lab, capsys, check, notebook, wrong, message):
    """On the lab's rank 0, as in the notebook: the key is loaded in this process only."""
    getattr(ddplab.check, check)(_notebook_solution(notebook, check))
    assert capsys.readouterr().out.startswith(f"Correct: {check}")
    assert fails(lambda: getattr(ddplab.check, check)(wrong)) == message
