"""The grader's own check: run a check cell where the submission's code never ran.

A check cell run in the submission's kernel can be forged by code that ran
there first: everything a checker relies on in that process (``Lab.run``,
``Calls``, ``torch``, ``print``, ``sys.stdout``, IPython's display and
hooks) is the submission's to replace, and putting things back
(``ddplab.course.grade_check``) only defends what it thinks of. So the
grading worker checks instead, in its own process:

1. Before the submission's first cell, the worker imports ``ddplab``, its
   checkers and ipyparallel (``prepare``), and drops the working folder from
   ``sys.path``: nothing the submission writes later can replace a module the
   check imports. The worker is non-dumpable (``procs.hide_memory``), so the
   kernel, a process of the same user, cannot ptrace it or write its memory.
2. After the exercise ran, the worker asks the kernel only where the lab is
   (its private directory), connects to the lab's controller with the
   connection file there, asks each engine its torch rank, and runs the
   reference check cell with ``lab`` and ``ddplab.current()`` bound to
   ``WitnessLab``, a handle of its own on the same ranks. The check's output
   and its exception are the worker's own: that output is compared with the
   reference, and it alone earns the point.
3. What the ranks send back is unpickled with ``SafeUnpickler``: plain data
   and tensors only. A rank cannot send an object whose unpickling runs code
   in the worker (a pickle ``__reduce__`` gadget).

This applies to a check cell that names nothing of the notebook but ``ddplab``
and ``lab`` (``ddplab.check.mean_score()``), and whose checker needs nothing
of the kernel's lab but ``run`` and ``world_size`` (``KERNEL_ONLY`` lists the
ones that trace). The choice is made from the reference's source alone, never
from what a submission does, so a submission cannot push a check back into
its kernel.

What this cannot defend against (README, "Grading a hostile class"):

- checks that take the student's objects from the notebook
  (``ddplab.check.swap_tensors(swap)``, ``who_waited((1, "recv"))``) or that
  trace: they still run in the kernel, guarded by ``grade_check``, which a
  submission that patches ``Lab.run`` in the kernel can forge;
- the ranks' state itself: the exercise ran on the ranks, so a submission can
  leave the right values there without computing them (a hard-coded answer),
  or patch what a checker calls on a rank; and the kernel says where the lab
  is, so a submission that replaces the lab's controller and engines with
  processes of its own answers the check itself.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import logging
import os
import pickle
import sys
import time
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

#: Names a witnessed check cell may use: everything else lives in the notebook.
GRADER_NAMES = frozenset({"ddplab", "lab"})
#: Checkers that need the kernel's lab beyond ``run`` (``lab.trace``): checked in the kernel.
KERNEL_ONLY = frozenset({"bf16_hook", "accumulate"})
#: Asked in the kernel before a witnessed check: where the lab is (printed as one JSON line).
WHERE = """\
def _ddplab_grade_where():
    import json
    import ddplab.lab.current_lab as current_lab
    lab = current_lab.current_or_none()
    where = json.dumps(lab.directory if lab is not None and lab.running else "")
    print("ddplab-where: " + where)
_ddplab_grade_where()
del _ddplab_grade_where"""


def witnessable(source: str) -> bool:
    """Whether the grader can run check ``source`` itself (see the module docstring)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    called = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return names <= GRADER_NAMES and "ddplab" in names and not called & KERNEL_ONLY


def where(outputs: list) -> str:
    """The lab directory the ``WHERE`` cell printed, or ''."""
    # One line can arrive in several stream messages on a busy machine: join them first.
    text = "".join(str(out.get("text", "")) for out in outputs if out.get("output_type") == "stream")
    for line in text.splitlines():
        if line.startswith("ddplab-where: "):
            try:
                found = json.loads(line.removeprefix("ddplab-where: "))
            except ValueError:
                return ""
            return found if isinstance(found, str) else ""
    return ""


# ------------------------------------------------------------------ unpickling
#: What a rank's answer may be built from: builtins' plain types, OrderedDict, and tensors.
SAFE_GLOBALS = {
    ("builtins", name) for name in ("set", "frozenset", "complex", "slice", "range", "bytearray",
                                    "list", "dict", "tuple", "int", "float", "bool", "str", "bytes")
} | {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
     ("torch._utils", "_rebuild_parameter"), ("torch", "Size"), ("torch", "device")}


def _tensor_storage(data: bytes) -> Any:
    """``torch.storage._load_from_bytes``, but with torch's weights-only unpickler."""
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


class SafeUnpickler(pickle.Unpickler):
    """Unpickles plain data and tensors; refuses any other global (a ``__reduce__`` gadget)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _tensor_storage
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a rank sent a {module}.{name}, which the grader does not "
                                     f"unpickle (plain data and tensors only)")


class _SafePickle:
    """What ipyparallel's serializer sees as ``pickle`` in the worker: safe ``loads``."""
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
    DEFAULT_PROTOCOL = pickle.DEFAULT_PROTOCOL
    PickleError = pickle.PickleError
    dumps = staticmethod(pickle.dumps)

    @staticmethod
    def loads(data: bytes, **_: Any) -> Any:
        # Not raised: ipyparallel unpickles replies in its own thread, where an
        # exception would lose the reply and the check would wait for it in vain.
        try:
            return SafeUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            return Refused(str(e))


class Refused(str):
    """A rank's reply the grader would not unpickle; why, as text."""


def prepare() -> None:
    """In the worker, before any cell of the submission: import what a check needs, seal it."""
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != os.getcwd()]
    import ipyparallel  # noqa: F401
    import ipyparallel.serialize.serialize as serialize
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import ddplab  # noqa: F401
    import ddplab.check  # noqa: F401
    from ddplab.lab import calls  # noqa: F401
    from ddplab.rank import engine  # noqa: F401
    serialize.pickle = _SafePickle


# ------------------------------------------------------------------ the lab
def _torch_rank() -> int:
    """On an engine: its torch rank, or -1 if it is in no group."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


class WitnessLab:
    """The grader's own handle on a lab's ranks: ``run`` and ``world_size``, as ``Lab`` has them."""

    def __init__(self, directory: str, timeout: float) -> None:
        import ipyparallel as ipp
        url_file = os.path.join(directory, "security", "ipcontroller-lab-client.json")
        if not os.path.isfile(url_file):
            raise AssertionError("the grader found no running lab to check "
                                 "(start one with lab = ddplab.start(world_size=2))")
        self.timeout = timeout
        self.client = ipp.Client(url_file, timeout=timeout)
        ranks = self._live_ranks(timeout)
        if sorted(ranks.values()) != list(range(len(ranks))):
            self.client.close()
            raise AssertionError("the lab's engines are not one group "
                                 f"(their ranks: {sorted(ranks.values())})")
        by_rank = {rank: eid for eid, rank in ranks.items()}
        self.engines = [by_rank[r] for r in range(len(ranks))]

    def _live_ranks(self, timeout: float) -> dict[int, int]:
        """Engine id -> torch rank of every live engine.

        Asked one engine at a time: for a few heartbeats after ``lab.restart()``
        the hub still lists the engines it killed, and a task sent to one of them
        fails with ``EngineError`` (one question to all of them would fail whole).
        """
        from ipyparallel.error import EngineError, RemoteError
        asked = {eid: self.client[eid].apply_async(_torch_rank) for eid in self.client.ids}
        ranks = {}
        for eid, answer in asked.items():
            try:
                ranks[eid] = answer.get(timeout)
            except (EngineError, RemoteError) as e:
                if isinstance(e, RemoteError) and e.ename != "EngineError":
                    raise
                log.debug("engine %s is gone (a restart's old engine)", eid)
        return ranks

    @property
    def world_size(self) -> int:
        return len(self.engines)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    @property
    def running(self) -> bool:
        return True

    def run(self, fn: Callable, *args: Any, ranks: Iterable[int] | None = None,
            timeout: float | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the ranks: by rank; ``RankError`` or ``HangError`` as ``Lab.run``."""
        from ddplab.errors import HangError
        from ddplab.lab.calls import rank_error
        from ddplab.rank import engine
        chosen = self.ranks if ranks is None else sorted(ranks)
        limit = self.timeout if timeout is None else timeout
        pending = {r: self.client[self.engines[r]].apply_async(engine.call, fn, args, kwargs)
                   for r in chosen}
        deadline = time.monotonic() + limit
        while not all(p.ready() for p in pending.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not all(p.ready() for p in pending.values()):
            states = {r: "finished" if p.ready() else "still running" for r, p in pending.items()}
            raise HangError(f"ddplab: the ranks did not finish within timeout={limit:g} s "
                            f"(a deadlock?)", states)
        outcomes = {r: p.get() for r, p in pending.items()}
        refused = {r: o for r, o in outcomes.items() if not isinstance(o, dict)}
        if refused:
            rank = min(refused)
            raise AssertionError(f"rank {rank}: {refused[rank]}")
        from ddplab.lab import display
        for r in sorted(outcomes):                   # what the ranks printed, as Lab.run shows it
            display.replay(r, outcomes[r]["events"])
        failures = {r: o["error"] for r, o in outcomes.items() if not o["ok"]}
        if failures:
            raise rank_error(failures)
        values = {r: o["value"] for r, o in outcomes.items()}
        return [values[r] for r in chosen] if ranks is None else values

    def close(self) -> None:
        self.client.close()


def check(source: str, directory: str, timeout: float,
          cwd: str = ".") -> tuple[list, tuple[str, str] | None, bool]:
    """Run check ``source`` against the lab in ``directory``, in ``cwd`` (the kernel's working
    folder, where a checker finds what the ranks wrote): (outputs, error, broke).

    ``error`` is the exception's (name, message), or None if the check passed;
    ``broke``: the ranks may still be running what the check sent (it timed
    out), so the kernel's lab is unusable.
    """
    from ddplab.errors import HangError
    from ddplab.lab import current_lab
    printed = io.StringIO()
    error, broke, lab = None, False, None
    before = current_lab.current_or_none()
    try:
        with contextlib.redirect_stdout(printed), contextlib.chdir(cwd):
            lab = WitnessLab(directory, timeout)
            current_lab.make_current(lab)      # what ddplab.check.x() finds when given no lab
            import ddplab
            exec(compile(source, "<check cell>", "exec"),
                 {"__builtins__": builtins, "ddplab": ddplab, "lab": lab})
    except Exception as e:
        # A deadlock the checker turned into an AssertionError leaves ranks busy too.
        error = (type(e).__name__, str(e))
        broke = isinstance(e, (HangError, TimeoutError)) or "a deadlock" in str(e)
    finally:
        current_lab.make_current(before)
        if lab is not None:
            lab.close()
    text = printed.getvalue()
    outputs = [{"output_type": "stream", "name": "stdout", "text": text}] if text else []
    return outputs, error, broke
