"""ddplab.check._keys: a checker's reference is loaded by the checker, and by nothing else.

A stand-in key (``standin.py``, a reference answer of one line) is written in a
folder of the test's, which the package is pointed at; a stand-in checker is a
function whose module is named ``ddplab.check.<something>``, as every checker's is.
The student's side is a cell of IPython's shell, and a function run on a lab's ranks.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest

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
