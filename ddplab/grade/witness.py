"""The grader's own check: run a check cell where the submission's code never ran.

A check cell run in the submission's kernel can be forged by code that ran
there first: everything a checker relies on in that process (``Lab.run``,
``Calls``, ``torch``, ``print``, ``sys.stdout``, ``exec``, IPython's display
and hooks) is the submission's to replace, and putting things back only
defends what it thinks of. So the grading worker checks instead, in its own
process:

1. Before the submission's first cell, the worker imports ``ddplab``, its
   checkers and ipyparallel (``prepare``), and drops the working folder from
   ``sys.path``: nothing the submission writes later can replace a module the
   check imports. The worker is non-dumpable (``procs.hide_memory``), so the
   kernel, a process of the same user, cannot ptrace it or write its memory.
2. After the exercise ran, the worker asks the kernel (``ask``) where the lab
   is (its private directory) and, as bytes, each name the check cell gives
   the checker (``swap`` in ``ddplab.check.swap_tensors(swap)``), and for a
   timeline checker the kernel's last trace. What the kernel answers is the
   submission's anyway; ``ddplab.grade.unpickle`` loads plain data and keeps code
   sealed: the student's function goes to the ranks as the kernel's own bytes
   and is unpickled there, never here.
3. The worker connects to the lab's controller itself (a ``Lab`` of its own
   over ``ddplab.lab.attached.AttachedRanks``) and runs the reference check
   cell with ``ddplab``, ``lab`` and ``ddplab.current()`` its own. The check's output and its
   exception are the worker's: that output is compared with the reference,
   and it alone earns the point. What the ranks send back is unpickled as
   plain data and tensors only.

Which cells: a check cell that is calls of ``ddplab.check`` functions, given
names and literals (``witnessable``): every check cell of the shipped
notebooks. The choice is made from the reference's source alone, never from
what a submission does, so a submission cannot push a check back into its
kernel. Another check cell (an instructor's ``assert f(3) == 9``) runs in the
kernel under ``ddplab.grade.guard``'s guard, which the grader says can be forged.

What this cannot defend against (docs/instructors.md, "Grading a hostile
class"): the ranks' state and the kernel's data are the submission's. A
submission can leave the right values on the ranks without computing them (a
hard-coded answer), patch what a checker calls on a rank, answer with a
made-up trace for a timeline question, or replace the lab's controller and
engines with processes of its own, which then answer the check.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import io
import os
import pickle
import sys
from typing import Any

from .unpickle import Refused, SafePickle, SafeUnpickler, load_name, load_trace, safe_loads

__all__ = ["GRADER_NAMES", "Refused", "SafePickle", "SafeUnpickler", "answer", "ask", "asked",
           "check", "prepare", "witnessable"]

#: Names a check cell uses that are the grader's own, never asked of the kernel.
GRADER_NAMES = frozenset({"ddplab", "lab"})
#: Asked in the kernel before a check: where the lab is, the names, the last trace (one line).
ASK = """\
def _ddplab_grade_ask(names, with_trace):
    import base64, dataclasses, pickle
    import cloudpickle
    import ddplab.lab.current_lab as current_lab
    import ddplab.trace
    namespace = get_ipython().user_ns
    lab = current_lab.current_or_none()
    found = {{"where": lab.directory if lab is not None and lab.running else "",
             "names": {{}}, "trace": None}}
    for name in [n for n in names if n in namespace]:
        value = namespace[name]
        try:
            if (dataclasses.is_dataclass(value) and not isinstance(value, type)
                    and type(value).__module__.startswith("ddplab.")):
                fields = {{f.name: getattr(value, f.name) for f in dataclasses.fields(value)}}
                kind = type(value).__module__ + "." + type(value).__qualname__
                found["names"][name] = ("record", kind, cloudpickle.dumps(fields))
            else:
                label = getattr(value, "__name__", None)
                found["names"][name] = ("pickle", cloudpickle.dumps(value),
                                        label if isinstance(label, str) else name)
        except Exception as e:
            found["names"][name] = ("unreadable", f"{{type(e).__name__}}: {{e}}")
    last = ddplab.trace.last() if with_trace else None
    if last is not None and last.events is not None:
        found["trace"] = pickle.dumps({{"ranks": list(last.ranks),
                                       "events": [dict(vars(e)) for e in last.events],
                                       "compute": [dict(vars(e)) for e in last.compute]}})
    print("ddplab-answer: " + base64.b64encode(pickle.dumps(found)).decode())
_ddplab_grade_ask({names!r}, {with_trace!r})
del _ddplab_grade_ask"""


def _checker_calls(tree: ast.Module) -> list[ast.Call] | None:
    """The ``ddplab.check.<name>(...)`` calls the cell is made of, or None if it is anything else."""
    calls = []
    for statement in tree.body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        func = call.func if isinstance(call, ast.Call) else None
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
                and func.value.attr == "check" and isinstance(func.value.value, ast.Name)
                and func.value.value.id == "ddplab"):
            return None
        if not all(_plain(a) for a in [*call.args, *(k.value for k in call.keywords)]):
            return None
        calls.append(call)
    return calls or None


def _plain(node: ast.AST) -> bool:
    """A name, a literal, or a tuple, list, set or dict of them: nothing that runs code here."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return isinstance(node.operand, ast.Constant)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_plain(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _plain(k) for k in node.keys) and all(map(_plain, node.values))
    return False


def _tree(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def witnessable(source: str) -> bool:
    """Whether the grader runs check ``source`` itself: calls of ``ddplab.check`` on names and literals."""
    tree = _tree(source)
    return tree is not None and _checker_calls(tree) is not None


def asked(source: str) -> tuple[list[str], bool]:
    """What to ask the kernel for check ``source``: the names it uses, and whether the last trace."""
    tree = _tree(source)
    calls = (_checker_calls(tree) if tree is not None else None) or []
    names = sorted({n.id for call in calls for arg in [*call.args, *(k.value for k in call.keywords)]
                    for n in ast.walk(arg) if isinstance(n, ast.Name)} - GRADER_NAMES)
    import ddplab.check as checkers
    return names, any(getattr(getattr(checkers, call.func.attr, None), "reads_trace", False)
                      for call in calls)


def ask(source: str) -> str:
    """The cell the worker runs in the kernel before check ``source`` (``ASK``)."""
    names, with_trace = asked(source)
    return ASK.format(names=names, with_trace=with_trace)


def answer(outputs: list) -> dict | None:
    """What the kernel answered to ``ask`` (where, names, trace), or None if it did not."""
    # One line can arrive in several stream messages on a busy machine: join them first.
    text = "".join(str(out.get("text", "")) for out in outputs if out.get("output_type") == "stream")
    for line in text.splitlines():
        if line.startswith("ddplab-answer: "):
            try:
                found = safe_loads(base64.b64decode(line.removeprefix("ddplab-answer: ")))
            except (ValueError, pickle.UnpicklingError):
                return None
            ok = (isinstance(found, dict) and isinstance(found.get("where"), str)
                  and isinstance(found.get("names"), dict)
                  and isinstance(found.get("trace"), (bytes, type(None))))
            return found if ok else None
    return None


def prepare() -> None:
    """In the worker, before any cell of the submission: import what a check needs, seal it."""
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != os.getcwd()]
    import cloudpickle  # noqa: F401
    import ipyparallel  # noqa: F401
    import ipyparallel.serialize.serialize as serialize
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import ddplab  # noqa: F401
    import ddplab.check  # noqa: F401
    import ddplab.launch  # noqa: F401
    import ddplab.trace  # noqa: F401
    from ddplab.lab import attached, calls, display, lab, owncode  # noqa: F401
    from ddplab.rank import engine, owngroup  # noqa: F401
    serialize.pickle = SafePickle


def check(source: str, found: dict, timeout: float,
          cwd: str = ".") -> tuple[list, tuple[str, str] | None, bool]:
    """Run check ``source`` on what the kernel answered (``found``), in ``cwd`` (the kernel's
    working folder, where a checker finds what the ranks wrote): (outputs, error, broke).

    ``error`` is the exception's (name, message), or None if the check passed;
    ``broke``: the ranks may still be running what the check sent (it timed
    out), so the kernel's lab is unusable.
    """
    import ddplab
    from ddplab import trace as tracing
    from ddplab.errors import HangError
    from ddplab.lab import attached, current_lab
    printed = io.StringIO()
    error, broke, lab = None, False, None
    before, before_trace = current_lab.current_or_none(), tracing.last()
    wanted, _ = asked(source)
    try:
        with contextlib.redirect_stdout(printed), contextlib.chdir(cwd):
            namespace: dict[str, Any] = {"__builtins__": builtins, "ddplab": ddplab}
            for name, value in found["names"].items():
                if name in wanted:                   # never more than was asked: not `ddplab`
                    namespace[name] = load_name(name, value)
            tracing.set_last(load_trace(found["trace"]))
            if found["where"]:
                lab = attached.attach(found["where"], timeout)
            namespace["lab"] = lab
            current_lab.make_current(lab)      # what ddplab.check.x() finds when given no lab
            exec(compile(source, "<check cell>", "exec"), namespace)
    except Exception as e:
        # A deadlock the checker turned into an AssertionError leaves ranks busy too.
        error = (type(e).__name__, str(e))
        broke = isinstance(e, (HangError, TimeoutError)) or "a deadlock" in str(e)
    finally:
        current_lab.make_current(before)
        tracing.set_last(before_trace)
        if lab is not None:
            lab.stop()
    text = printed.getvalue()
    outputs = [{"output_type": "stream", "name": "stdout", "text": text}] if text else []
    return outputs, error, broke
