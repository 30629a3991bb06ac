"""What every checker shares: fetch answers from the ranks, compare, report.

A checker prints one fixed line when the answer is right, so nbval can
compare it, and raises ``AssertionError`` when it is wrong, with a table of
what each rank should have held and what it held. Raising (never printing)
is what makes a wrong answer fail the cell, and so fail grading.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..text import plural

#: What a rank answers for a name its namespace lacks: the exercise cell did not run there, or
#: used another name. A string rather than an ``object()``: it comes back from the rank pickled,
#: and a copy of an object() is not the object, while a string compares equal (``is_missing``).
MISSING = "<not defined on this rank>"


def is_missing(value: Any) -> bool:
    """Whether a rank answered ``MISSING``."""
    return isinstance(value, str) and value == MISSING


def _lookup(name: str) -> Any:
    """On a rank: the value of ``name`` in its namespace, or ``MISSING`` if there is none."""
    from ddplab.rank.engine import namespace

    return namespace().get(name, MISSING)


def lab_or_current(lab: Any = None) -> Any:
    """The lab to check: the one given, or the one running."""
    from ddplab.lab.current_lab import current

    return lab if lab is not None else current()


def values_on_ranks(name: str, lab: Any = None) -> list[Any]:
    """The variable ``name`` on every rank, indexed by rank.

    Raises ``AssertionError`` naming the ranks where it is missing, since that
    means the exercise cell did not run there (or used another name).
    """
    lab = lab_or_current(lab)
    values = lab.run(_lookup, name)
    missing = [rank for rank, value in enumerate(values) if is_missing(value)]
    if missing:
        where = ", ".join(map(str, missing))
        raise AssertionError(f"no variable `{name}` on {plural(len(missing), 'rank')} {where}. "
                             f"Run the exercise cell above (it must run on every rank: %%ranks) "
                             f"and keep the name `{name}`.")
    return values


def run_on_ranks(fn: Callable, *args: Any, lab: Any = None, **kwargs: Any) -> list[Any]:
    """Call ``fn`` on every rank; a student's exception fails the check with that rank's traceback."""
    return lab_or_current(lab).run(fn, *args, **kwargs)


def _answer_each(fn: Callable, calls: list[tuple]) -> list[tuple]:
    """``fn(*args)`` for each ``args``: ``("ok", value)`` or ``("raised", name, message)``."""
    answers: list[tuple] = []
    for args in calls:
        try:
            answers.append(("ok", fn(*args)))
        except Exception as exc:  # noqa: BLE001 - a wrong answer, reported like one
            answers.append(("raised", type(exc).__name__, str(exc)))
    return answers


def answers_of(fn: Callable, calls: list[tuple], lab: Any = None) -> list[tuple]:
    """The student's ``fn(*args)`` for each of ``calls``, computed on rank 0 of the running lab.

    For an exercise that is a plain function (``physical_gpu``, ``zero_bytes``):
    run where the student's code runs, on a rank, so that a grader can check it
    without ever running the student's code in its own process
    (``ddplab.grade.witness``). With no lab running, here. Each answer is
    ``("ok", value)`` or ``("raised", exception name, message)``.
    """
    from ddplab.lab.current_lab import current_or_none

    lab = lab if lab is not None else current_or_none()
    if lab is None or not lab.running:
        return _answer_each(fn, calls)
    return lab.run(_answer_each, fn, calls, ranks=[0])[0]


def spell_raised(answer: tuple) -> str:
    """``raised IndexError: list index out of range`` for a ``("raised", ...)`` answer."""
    return f"raised {answer[1]}" + (f": {answer[2]}" if answer[2] else "")


#: Seconds the first DDP step of a fresh rank may take (imports torch's lazy modules): not a deadlock.
WARM_UP_TIMEOUT = 120.0


def _ddp_step_once() -> None:
    """On a rank: import ddplab's training modules and run one tiny DDP step (a collective)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab import data, train

    data.digits()
    device = train.device_for_this_rank()
    model = DDP(torch.nn.Linear(2, 1).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    model(torch.ones(1, 2, device=device)).sum().backward()


def warm_up_ddp(lab: Any = None) -> None:
    """Make every rank import what a DDP check needs, with a generous timeout, before the check's own.

    A fresh rank's first DDP step imports modules of torch's for seconds (tens of
    seconds on a loaded machine), which a check's short deadlock timeout would
    mistake for a deadlock in the student's code.
    """
    run_on_ranks(_ddp_step_once, lab=lab, timeout=WARM_UP_TIMEOUT)


def _raised(traceback_text: str) -> str:
    """The exception a formatted traceback ends with: ``NotImplementedError: ...`` -> its name."""
    lines = [line for line in traceback_text.strip().splitlines() if line and not line[0].isspace()]
    last = lines[-1] if lines else ""
    name = last.split(":", 1)[0].strip()
    return name if name.replace(".", "").replace("_", "").isalnum() else "an exception"


def run_student_code(what: str, fn: Callable, *args: Any, lab: Any = None, timeout: float,
                     hint: str, ranks: Any = None, each: dict[int, tuple] | None = None) -> Any:
    """``run_on_ranks``, where ``fn`` runs the student's code: its failures become AssertionErrors.

    A ``RankError`` (the student's code raised) fails the check with each
    rank's traceback; a ``HangError`` fails it with ``deadlock``'s message,
    ``hint`` saying what usually causes the hang. ``what`` names the code,
    e.g. ``"my_all_reduce(...)"``. With ``ranks``, only those run it (results by rank, a dict).
    With ``each``, rank ``r`` runs ``fn(*args, *each[r])``, sent only its own arguments
    (``Lab.run_each``; results by rank, a dict).
    """
    from ddplab.errors import HangError, RankError

    __tracebackhide__ = True
    try:
        if each is not None:
            return lab_or_current(lab).run_each(fn, each, *args, timeout=timeout)
        if ranks is not None:
            return run_on_ranks(fn, *args, lab=lab, timeout=timeout, ranks=ranks)
        return run_on_ranks(fn, *args, lab=lab, timeout=timeout)
    except RankError as exc:
        # The first line names what was raised: a grader's one-line reason shows only it.
        raised = sorted({_raised(text) for text in exc.failures.values()}) or ["an exception"]
        raise AssertionError(f"{what} raised {' / '.join(raised)}, so it cannot be checked:"
                             f"\n{exc}") from None
    except HangError as exc:
        raise deadlock(what, exc, timeout, hint) from None


def _with_student_function(name: str, fn: Callable, *args: Any) -> Any:
    """On a rank: ``fn(the student's function `name`, *args)``, or ``MISSING`` where there is none."""
    from ddplab.rank.engine import namespace

    student = namespace().get(name)
    return fn(student, *args) if callable(student) else MISSING


def run_student_function(name: str, fn: Callable, *args: Any, lab: Any, timeout: float,
                         hint: str, each: dict[int, tuple] | None = None) -> list[Any]:
    """``fn(the student's function `name`, *args)`` on every rank, results by rank.

    ``fn`` is the checker's own code, run on the rank, which calls the student's
    function as the exercise asks. Whatever goes wrong fails the check with an
    ``AssertionError`` that names the fix: no function ``name`` on some ranks
    (``require_function``), the student's code raised, or it hung
    (``run_student_code``, with ``hint``). With ``each`` (one entry per rank),
    rank ``r`` runs ``fn(student, *args, *each[r])``, sent only its own ``each[r]``.
    """
    __tracebackhide__ = True
    got = run_student_code(f"{name}(...)", _with_student_function, name, fn, *args, lab=lab,
                           timeout=timeout, hint=hint, each=each)
    if each is not None:
        got = [got[rank] for rank in sorted(got)]
    require_function(got, name)
    return got


def deadlock(what: str, exc: Any, timeout: float, hint: str) -> AssertionError:
    """The AssertionError for a student's code that hung: where each rank is stuck, and the way out.

    ``exc`` is the lab's ``HangError``; its per-rank locations become lines
    like ``rank 0: still in send (cell line 2)``.
    """
    where = "\n".join(f"  rank {rank}: {'still ' + exc.where[rank] if rank in exc.where else state}"
                      for rank, state in exc.states.items())
    return AssertionError(f"{what} did not finish within {timeout:g} s: the ranks are waiting for "
                          f"each other (a deadlock).\n{where}\nHint: {hint} "
                          f"Then recover with: lab.restart()")


#: The point-to-point calls the checkers watch, and the keyword naming the other rank.
PEER_KEYWORD = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


def peer(args: tuple, kwargs: dict, keyword: str) -> Any:
    """The other rank of a send or recv call, as a global rank.

    ``dst=``/``src=`` or the second argument; or ``group_dst=``/``group_src=``,
    a rank within ``group=``, which is how ``batch_isend_irecv`` calls each op.
    """
    if keyword in kwargs:
        return kwargs[keyword]
    if len(args) > 1:
        return args[1]
    group_peer, group = kwargs.get("group_" + keyword), kwargs.get("group")
    if group_peer is None or group is None:
        return group_peer
    import torch.distributed as dist
    return dist.get_global_rank(group, group_peer)


def swap_peer_calls(wrap: Callable) -> Callable[[], None]:
    """Replace send/recv/isend/irecv by ``wrap(name, keyword, real)``; returns the undo.

    One replacement per name, set in both ``torch.distributed`` and
    ``distributed_c10d``: ``P2POp`` accepts an op only if it *is*
    ``distributed_c10d.isend`` or ``irecv``, so a student's
    ``P2POp(dist.isend, ...)`` must find the very same object there.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = {(module, name): getattr(module, name) for module in (dist, c10d) for name in PEER_KEYWORD}
    for name, keyword in PEER_KEYWORD.items():
        replacement = wrap(name, keyword, saved[(dist, name)])
        for module in (dist, c10d):
            setattr(module, name, replacement)

    def undo() -> None:
        for (module, name), value in saved.items():
            setattr(module, name, value)
    return undo


def require_function(got: list[Any], name: str, kind: str = "function",
                     verb: str = "defines") -> None:
    """Raise naming the ranks where the student's ``name`` was not defined (they answered ``MISSING``)."""
    missing = [rank for rank, value in enumerate(got) if is_missing(value)]
    if missing:
        raise AssertionError(
            f"no {kind} `{name}` on {plural(len(missing), 'rank')} "
            f"{', '.join(map(str, missing))}. Run the exercise cell above (a %%ranks cell, so "
            f"every rank {verb} it) without errors, and keep the name `{name}`.")


def same(expected: Any, got: Any, atol: float = 0.0) -> bool:
    """Equal values: tensors by shape, dtype class and elements; lists item by item."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return False
        if got.dtype.is_floating_point != expected.dtype.is_floating_point:
            return False
        if atol:
            return bool(torch.allclose(got.double(), expected.double(), atol=atol, rtol=0))
        return bool(torch.equal(got.to(expected.dtype), expected))
    if isinstance(expected, (list, tuple)):
        return (isinstance(got, (list, tuple)) and len(got) == len(expected)
                and all(same(e, g, atol) for e, g in zip(expected, got)))
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(expected, got, abs_tol=atol) if atol else expected == got
    return type(expected) is type(got) and expected == got


def _spell(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{value.tolist()} ({dtype})"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        inner = ", ".join(_spell(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def compare(what: str, expected: list[Any], got: list[Any], atol: float = 0.0,
            hint: str = "") -> None:
    """Raise ``AssertionError`` with a per-rank table unless ``got`` matches ``expected``.

    ``expected`` and ``got`` are indexed by rank. Rows of ranks that are wrong
    are marked with ``<-- wrong``; ``hint`` is a sentence on what usually causes it.
    """
    __tracebackhide__ = True   # IPython and pytest show the message, not this frame
    wrong = [rank for rank, (e, g) in enumerate(zip(expected, got)) if not same(e, g, atol)]
    if len(expected) != len(got):
        ranks = f"{len(expected)} {plural(len(expected), 'rank')}"
        raise AssertionError(f"{what}: expected answers from {ranks}, got {len(got)}.")
    if not wrong:
        return
    lines = [f"{what} is wrong on {plural(len(wrong), 'rank')} {', '.join(map(str, wrong))}."]
    for rank, (e, g) in enumerate(zip(expected, got)):
        mark = "   <-- wrong" if rank in wrong else ""
        lines.append(f"  rank {rank}: expected {_spell(e)}")
        lines.append(f"  {' ' * len(str(rank))}      got      {_spell(g)}{mark}")
    if hint:
        lines.append(f"Hint: {hint}")
    raise AssertionError("\n".join(lines))


def passed(message: str) -> None:
    """The one fixed line a checker prints on success."""
    print(f"Correct: {message}")
