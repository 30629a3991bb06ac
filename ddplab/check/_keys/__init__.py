"""Answer keys: the checkers' own references, which only a checker can load.

A check that compares the student's number with its own (``predict_step``,
``fits_budget``, ``bubble_fraction``...) computes that number with a reference.
Kept as a function of a checker module (it was
``ddplab.check.nb15_at_scale.predictions._fits_right``), it was one import away
for the student's cell and for code on the ranks: a submission could return the
checker's own answer. Here each reference is a module of this package: ``scale``
(notebook 15's step time, budget, micro-batches and replay growth) and
``pipelines`` (notebook 13's bubble fraction); and:

- **No import reaches it.** ``import ddplab.check._keys.scale`` (or ``from ...
  import``, ``importlib.import_module``) raises ``ImportError`` naming the rule:
  a finder at the front of ``sys.meta_path`` refuses every name under this
  package, and the package's ``__path__`` is empty, so with that finder removed
  the import still finds nothing.
- **``load(name)`` serves a checker only.** It returns a fresh module object,
  never put in ``sys.modules``, and refuses (the same ``ImportError``) when its
  caller is not a module of ``ddplab.check`` (the caller's ``__name__``), or
  when it runs on a rank of a lab: the references are computed in the kernel
  (or the grading worker), never where the student's code runs during a check.
- **A checker keeps no key on a name.** It calls ``load`` inside the check and
  drops the module when the check returns; ``tests/test_answer_keys.py`` refuses
  a module-level ``load`` anywhere in ``ddplab/check``, since a module attribute
  would be the import path again.

What this defends against: a cell or a rank importing or calling a checker's
reference by its name, by accident or on purpose, in the notebook and under
``ddplab grade``. What it does not: code that reads the installed source file
(the student owns their copy of ddplab) or forges its caller's ``__name__``
(``exec`` with globals of its own). Under ``ddplab grade`` the sandbox is where
that is closed: each key's source is an empty file inside it, and the
grading worker, which runs every check itself (``ddplab.grade.witness``), gets
them as compiled code before the submission's first cell runs (``seal``, from
the file ``ddplab.grade.sandbox`` wrote, which it deletes); the kernel it starts
next finds neither the file nor its name, and cannot read the worker's memory
(``procs.hide_memory``). ``ddplab.check`` imports this package, so the worker's
``import ddplab.check`` is what seals it.

How a checker uses this::

    from . import _keys

    def fits_budget(fn, lab=None):
        scale = _keys.load("scale")                    # in the check, never at module level
        expected = scale.fits_right(rows, budget)
"""

from __future__ import annotations

import importlib.abc
import marshal
import os
import sys
import types
from pathlib import Path

__all__ = ["ENV", "KeyRefused", "load", "names", "seal"]

FOLDER = Path(__file__).resolve().parent
PACKAGE = __name__
#: Compiled keys handed to a grading worker (``seal``): name -> marshalled code.
_sealed: dict[str, bytes] = {}
#: The variable that names them (``ddplab.grade.sandbox.ANSWER_KEYS_VARIABLE``).
ENV = "DDPLAB_ANSWER_KEYS"


class KeyRefused(ImportError):
    """Code outside the checkers asked for an answer key."""


def _refusal(name: str, how: str) -> KeyRefused:
    return KeyRefused(
        f"ddplab: {PACKAGE}.{name} is a checker's answer key, and {how} is refused: code in a "
        f"notebook cell or on the ranks never sees the answer its check compares with. Compute "
        f"the answer yourself, as the exercise describes; the check says what differs.")


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses every module under the package, whoever imports it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(PACKAGE + "."):
            raise _refusal(fullname[len(PACKAGE) + 1:], "importing it")
        return None


def _install_finder() -> None:
    if not any(isinstance(finder, _Refuse) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Refuse())


_install_finder()
__path__: list[str] = []          # nothing under the package is found on disk by import either


def names() -> list[str]:
    """The keys there are: this folder's modules, or what ``seal`` was given."""
    found = sorted(_sealed) or sorted(p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__")
    return found


def _on_a_rank() -> bool:
    engine = sys.modules.get("ddplab.rank.engine")
    return bool(engine is not None and engine.in_lab())


def _caller_is_a_checker(depth: int) -> bool:
    caller = sys._getframe(depth).f_globals.get("__name__", "")
    return caller.startswith("ddplab.check.") and not caller.startswith(PACKAGE)


def load(name: str) -> types.ModuleType:
    """The answer key ``name`` as a fresh module (not in ``sys.modules``); checkers only.

    Raises ``KeyRefused`` (an ``ImportError``) for any other caller, or on a rank.
    """
    if _on_a_rank():
        raise _refusal(name, "loading it on a rank")
    if not _caller_is_a_checker(2):
        raise _refusal(name, "loading it from outside ddplab's checkers")
    if name in _sealed:
        code = marshal.loads(_sealed[name])
    else:
        path = FOLDER / f"{name}.py"
        if not path.is_file() or name.startswith("_"):
            raise KeyError(f"ddplab: no answer key {name!r}; there are {', '.join(names())}.")
        code = compile(path.read_text(), str(path), "exec")
    module = types.ModuleType(f"{PACKAGE}.{name}", f"ddplab's answer key {name} (loaded by a checker)")
    exec(code, module.__dict__)
    return module


def seal(path: str | os.PathLike) -> bool:
    """Serve ``load`` from the compiled keys in ``path`` (``ddplab.grade.sandbox.answer_keys_blob``),
    and delete the file. False when there is no such file."""
    try:
        blob = Path(path).read_bytes()
    except FileNotFoundError:
        return False
    os.unlink(path)
    _sealed.update(marshal.loads(blob))
    return True


def _seal_for_the_grader() -> None:
    """In a grading worker, when this package is first imported (``witness.prepare`` imports
    ``ddplab.check``, before the submission's first cell): take the keys the sandbox wrote, and
    the variable naming them, out of reach of the kernel the worker starts next."""
    path = os.environ.pop(ENV, None)
    if path:
        seal(path)


_seal_for_the_grader()
