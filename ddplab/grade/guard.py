"""How the grader runs a check cell in the submission's kernel, when it cannot run it itself.

A grading worker runs every check cell that calls ``ddplab.check`` in its own
process (``ddplab.grade.witness``), out of the submission's reach:
every check cell of the shipped notebooks. Another check cell (an
instructor's own ``assert f(3) == 9``) runs in the submission's kernel,
where the submission's code ran first; this is its guard, and it can be
forged (the grader warns of such cells). Before such a check, the grader:

- at the kernel's start, before any cell of the submission, keeps the
  streams and ``print`` a verdict goes through, the import system
  (``sys.meta_path``, ``sys.path_hooks``) and the attributes of builtins,
  ``torch`` and ``torch.Tensor`` (``SAVE_STREAMS``), all put back before
  each check;
- runs the check cell as ``guarded_check(source, nonce)``: the kept streams
  and ``print`` put back, ``ddplab`` and ``ddplab.check`` imported afresh
  from their files (a replaced, wrapped or re-coded checker, or a fake
  ``ddplab`` in the notebook's namespace, is not what runs), then the
  reference check source, then a verdict line carrying ``nonce``, drawn by
  the worker for this cell alone (it is in no file, variable or argument
  the submission can see before the cell runs);
- reads the verdict (``verdict``): only ``pass`` with that nonce earns the
  point, and the verdict lines are removed before outputs are compared.

What this cannot stop, for the checks that run in the kernel
(docs/instructors.md, "Grading a hostile class"): code that changes what the
checker relies on beyond what is put back (``ddplab.lab``'s ``Lab.run``,
another module's functions, the guard's own names shadowed in the notebook's
namespace, such as ``exec`` or ``get_ipython``, IPython's hooks, which see the
cell and its nonce).
"""

from __future__ import annotations

import re

# Run first in every kernel, before any cell of the submission: keeps the
# streams and print that a check's verdict goes through, the import system,
# and the attributes of what a checker computes with (builtins, torch and its
# Tensor class), to be put back before each check.
SAVE_STREAMS = """\
import sys as _s, builtins as _b, types as _t, torch as _torch
_m = _t.ModuleType("_ddplab_grade_saved")
_m.stdout, _m.stderr, _m.print = _s.stdout, _s.stderr, _b.print
_m.meta_path, _m.path_hooks = list(_s.meta_path), list(_s.path_hooks)
_m.attrs = [(_o, dict(vars(_o))) for _o in (_b, _torch, _torch.Tensor)]
_s.modules["_ddplab_grade_saved"] = _m
del _s, _b, _t, _m, _torch"""
# A check cell, as the grader runs it: with what was saved above put back,
# ``ddplab`` and ``ddplab.check`` imported afresh from their files
# (a replaced, wrapped or re-coded checker, or a fake ``ddplab`` in the
# notebook's namespace, is not what runs), and a verdict line carrying a
# nonce the grader drew for this cell alone. Only that line with that nonce
# earns the point; it is removed before outputs are compared.
CHECK = """\
def _ddplab_grade_check(source, nonce):
    import builtins, sys
    saved = sys.modules.get("_ddplab_grade_saved")
    if saved is not None:
        sys.stdout, sys.stderr, builtins.print = saved.stdout, saved.stderr, saved.print
        sys.meta_path, sys.path_hooks = list(saved.meta_path), list(saved.path_hooks)
        for owner, attrs in saved.attrs:
            for key, value in attrs.items():
                if vars(owner).get(key) is not value:
                    try:
                        setattr(owner, key, value)
                    except (AttributeError, TypeError):
                        pass
            if isinstance(owner, type):         # a method added over an inherited one
                for key in [k for k in vars(owner) if k not in attrs]:
                    try:
                        delattr(owner, key)
                    except (AttributeError, TypeError):
                        pass
    for name in [n for n in list(sys.modules)
                 if n in ("ddplab", "ddplab.check") or n.startswith("ddplab.check.")]:
        del sys.modules[name]
    import ddplab
    import ddplab.check
    namespace = dict(get_ipython().user_ns)
    namespace["ddplab"] = ddplab
    try:
        exec(compile(source, "<check cell>", "exec"), namespace)
    except BaseException:
        sys.stdout.write("ddplab-verdict %s fail\\n" % nonce)
        raise
    sys.stdout.write("ddplab-verdict %s pass\\n" % nonce)
_ddplab_grade_check({source!r}, {nonce!r})"""
VERDICT = re.compile(r"^ddplab-verdict (\S+) (pass|fail)\n?", re.M)


def guarded_check(source: str, nonce: str) -> str:
    """The source the grader runs for a check cell (``CHECK``)."""
    return CHECK.format(source=source, nonce=nonce)


def verdict(outputs: list, nonce: str) -> tuple[str, list]:
    """('pass', 'fail' or '' if no line carried ``nonce``) and the outputs without verdict lines."""
    found, kept = "", []
    for out in outputs:
        if out.get("output_type") == "stream":
            text = out.get("text", "")
            for match in VERDICT.finditer(text):
                if match.group(1) == nonce and not found:
                    found = match.group(2)
            text = VERDICT.sub("", text)
            if text:
                kept.append(dict(out, text=text))
            continue
        kept.append(out)
    return found, kept
