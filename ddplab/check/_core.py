"""What every checker shares: the lab it checks, the student's code run on the ranks, compare, pass.

A checker is a function decorated with ``@checker``: its ``lab`` argument
arrives resolved (the one given, or the running one). It prints one fixed
line when the answer is right (``passed``), so nbval can compare it, and
raises a ``Feedback`` (``_feedback``) when it is wrong: a headline naming
the mistake, a table of what each rank should have held and what it held
(``compare``), and a hint. Raising (never printing) is what makes a wrong
answer fail the cell, and so fail grading.

The student's code runs on the ranks through ``run_student_code``: what it
raises becomes the student's own exception, by name and line, with their
traceback alone; a deadlock says where each rank waits (``_student``).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

from ..text import plural
from . import _student
from ._feedback import Feedback, Row, float32_rounding, ranks_phrase, spell, spell_against

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
    """The lab to check: the one given, or the one running (raises naming the fix if none runs)."""
    from ddplab.lab.current_lab import current

    return lab if lab is not None else current()


def checker(fn: Callable | None = None, *, needs_lab: bool = True, reads_trace: bool = False) -> Any:
    """Make ``fn`` a checker: its ``lab`` argument is resolved once, here, before it runs.

    With ``needs_lab`` (the default) ``lab`` is the one given or the running one,
    and no lab running fails at once, naming the fix; without, it is the one
    given or the current one, running or not, or None (a checker of a plain
    function runs it on rank 0 if it can, else here: ``answers_of``).
    ``reads_trace``: the checker reads the last ``lab.trace()`` (a grader hands it
    the student's; ``ddplab.grade.witness``).
    """
    if fn is None:
        return functools.partial(checker, needs_lab=needs_lab, reads_trace=reads_trace)
    signature = inspect.signature(fn)
    takes_lab = "lab" in signature.parameters
    answers = [name for name, p in signature.parameters.items()    # what a check cell passes
               if name != "lab" and p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]

    @functools.wraps(fn)
    def check(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not takes_lab:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        lab = bound.arguments["lab"]
        if lab is not None and not hasattr(lab, "run_each"):    # a student's function, a number
            usage = f"ddplab.check.{fn.__name__}({', '.join(answers)})"
            given = (f"the function {lab.__name__}" if callable(lab) and hasattr(lab, "__name__")
                     else spell(lab))
            raise Feedback(f"{usage} was given {given} where it takes the lab (or nothing: the "
                           f"running one)" + ("; it finds your answer by name on the ranks." if not answers
                                              else "."),
                           hint=f"call it as the check cell does: {usage}.")
        if lab is None:
            from ddplab.lab.current_lab import current, current_or_none
            bound.arguments["lab"] = current() if needs_lab else current_or_none()
        return fn(*bound.args, **bound.kwargs)

    check.reads_trace = reads_trace      # type: ignore[attr-defined]
    return check


def values_on_ranks(name: str, lab: Any = None) -> list[Any]:
    """The variable ``name`` on every rank, indexed by rank.

    Raises ``Feedback`` naming the ranks where it is missing, since that
    means the exercise cell did not run there (or used another name).
    """
    values = lab_or_current(lab).run(_lookup, name)
    missing = [rank for rank, value in enumerate(values) if is_missing(value)]
    if missing:
        raise Feedback(f"no variable `{name}` on {ranks_phrase(missing)}.",
                       hint=f"run the exercise cell above (it must run on every rank: %%ranks) "
                            f"and keep the name `{name}`.")
    return values


def run_on_ranks(fn: Callable, *args: Any, lab: Any = None, **kwargs: Any) -> list[Any]:
    """Call the checker's own ``fn`` on every rank (no student code in it: see ``run_student_code``)."""
    return lab_or_current(lab).run(fn, *args, **kwargs)


def _answer_each(fn: Callable, calls: list[tuple]) -> list[tuple]:
    """``fn(*args)`` for each ``args``: ``("ok", value)`` or ``("raised", name, message, described)``."""
    answers: list[tuple] = []
    for args in calls:
        try:
            answers.append(("ok", fn(*args)))
        except Exception as exc:  # noqa: BLE001 - a wrong answer, reported like one
            answers.append(("raised", type(exc).__name__, str(exc), _student.describe(exc)))
    return answers


def answers_of(fn: Callable, calls: list[tuple], lab: Any = None) -> list[tuple]:
    """The student's ``fn(*args)`` for each of ``calls``, computed on rank 0 of the running lab.

    For an exercise that is a plain function (``physical_gpu``, ``zero_bytes``):
    run where the student's code runs, on a rank, so that a grader can check it
    without ever running the student's code in its own process
    (``ddplab.grade.witness``). With no lab running, here. Each answer is
    ``("ok", value)`` or ``("raised", exception name, message, what the student needs of it)``;
    ``student_raised`` is the feedback for the second kind.
    """
    from ddplab.lab.current_lab import current_or_none

    lab = lab if lab is not None else current_or_none()
    if lab is None or not lab.running:
        return _answer_each(fn, calls)
    return lab.run(_answer_each, fn, calls, ranks=[0])[0]


def spell_raised(answer: tuple) -> str:
    """``raised IndexError: list index out of range`` for a ``("raised", ...)`` answer."""
    return f"raised {answer[1]}" + (f": {answer[2]}" if answer[2] else "")


def student_raised(what: str, answer: tuple, hint: str = "") -> Feedback:
    """The feedback for a ``("raised", ...)`` answer of ``answers_of``: the student's exception
    first, by name and line, then their traceback; ``what`` is the call the check made, ``hint``
    what the checker adds to ddplab's own advice for that exception."""
    return _student.answer_raised(what, answer[3], hint) if len(answer) > 3 else \
        Feedback(f"{what} {spell_raised(answer)}.", hint=hint)


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


#: Where a ``RankError``'s message says what the other ranks did meanwhile (``lab.calls``).
_MEANWHILE = "\nMeanwhile:\n"


def run_student_code(what: str, fn: Callable, *args: Any, lab: Any = None, timeout: float,
                     hint: str, ranks: Any = None, each: dict[int, tuple] | None = None) -> Any:
    """``fn(*args)`` on every rank, where ``fn`` (the checker's) runs the student's code.

    What goes wrong becomes a ``Feedback``: the student's exception, by name
    and line, with their own traceback (a refusal the check raised on the
    ranks, shown once); or, for a hang, where each rank waits and a hint that
    fits it (``hint``: the checker's word on what usually hangs here, used
    where the lab names no pattern). ``what`` names the code, e.g.
    ``"my_all_reduce(...)"``. With ``ranks``, only those run it (results by rank,
    a dict). With ``each``, rank ``r`` runs ``fn(*args, *each[r])``, sent only
    its own arguments (``Lab.run_each``; results by rank, a dict).
    """
    from ddplab.errors import HangError, RankError

    __tracebackhide__ = True
    lab = lab_or_current(lab)
    try:
        if each is not None:
            return lab.run_each(_student.call, each, fn, *args, timeout=timeout)
        if ranks is not None:
            return lab.run(_student.call, fn, *args, timeout=timeout, ranks=ranks)
        return lab.run(_student.call, fn, *args, timeout=timeout)
    except RankError as exc:
        text = str(exc)
        meanwhile = text[text.index(_MEANWHILE) + 1:] if _MEANWHILE in text else ""
        raise _student.raised(what, exc.failures, meanwhile) from None
    except HangError as exc:
        raise _student.hung(what, exc, timeout, hint) from None


def _with_student_function(name: str, fn: Callable, *args: Any) -> Any:
    """On a rank: ``fn(the student's function `name`, *args)``, or ``MISSING`` where there is none."""
    from ddplab.rank.engine import namespace

    student = namespace().get(name)
    return fn(student, *args) if callable(student) else MISSING


def run_student_function(name: str, fn: Callable, *args: Any, lab: Any, timeout: float,
                         hint: str, each: dict[int, tuple] | None = None) -> list[Any]:
    """``fn(the student's function `name`, *args)`` on every rank, results by rank.

    ``fn`` is the checker's own code, run on the rank, which calls the student's
    function as the exercise asks. Whatever goes wrong fails the check with a
    ``Feedback`` that names the fix: no function ``name`` on some ranks
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


def require_function(got: list[Any], name: str, kind: str = "function",
                     verb: str = "defines") -> None:
    """Raise naming the ranks where the student's ``name`` was not defined (they answered ``MISSING``)."""
    missing = [rank for rank, value in enumerate(got) if is_missing(value)]
    if missing:
        raise Feedback(f"no {kind} `{name}` on {ranks_phrase(missing)}.",
                       hint=f"run the exercise cell above (a %%ranks cell, so every rank {verb} "
                            f"it) without errors, and keep the name `{name}`.")


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


#: The hint for a float64 answer computed in float32 somewhere (``compare``).
FLOAT32_HINT = ("keep every step in float64: a tensor made without dtype= (torch.tensor(0.5), "
                "torch.zeros(n), torch.ones(n)) is float32, and .float() casts to it; make new "
                "tensors with the input's dtype (torch.zeros_like(x), dtype=x.dtype).")


def wrong_rows(expected: list[Any], got: list[Any], wrong: list[int],
               show_expected: bool | str = True) -> list[Row]:
    """The table of ``compare``: every rank's expected and got, the wrong ones marked.

    ``show_expected``: True shows each expected value; words (``"the mean of all
    6 scores"``) stand in for a value that is the answer itself; False shows none.
    """
    def said(e: Any) -> str | None:
        return spell(e) if show_expected is True else (show_expected or None)

    return [Row(rank, spell_against(e, g) if rank in wrong and show_expected is True else spell(g),
                said(e), rank in wrong)
            for rank, (e, g) in enumerate(zip(expected, got))]


def compare(what: str, expected: list[Any], got: list[Any], atol: float = 0.0,
            hint: str = "", show_expected: bool | str = True, mistake: str = "") -> None:
    """Raise ``Feedback`` with a per-rank table unless ``got`` matches ``expected``.

    ``expected`` and ``got`` are indexed by rank. Rows of ranks that are wrong
    are marked with ``<-- wrong``; ``hint`` is a sentence on what usually causes
    it. Where the expected value is the answer itself (a number the student
    must produce, not one made from inputs the check drew), ``show_expected`` is
    the words that stand in for it (or False): the table shows what came, never
    the answer. ``mistake``: the headline's words for the mistake the checker
    recognised (``"holds the mean of the ranks' means"``), said instead of "is wrong".
    A float64 answer wrong only by float32's rounding is named as that mistake.
    """
    __tracebackhide__ = True   # IPython and pytest show the message, not this frame
    if len(expected) != len(got):
        ranks = f"{len(expected)} {plural(len(expected), 'rank')}"
        raise Feedback(f"{what}: expected answers from {ranks}, got {len(got)}.")
    wrong = [rank for rank, (e, g) in enumerate(zip(expected, got)) if not same(e, g, atol)]
    if not wrong:
        return
    rows = wrong_rows(expected, got, wrong, show_expected)
    if all(float32_rounding(expected[rank], got[rank]) for rank in wrong):
        raise Feedback(f"{what} is off on {ranks_phrase(wrong)} by float32's rounding, not by a "
                       f"mistake in the method: your code computes in float32 somewhere.",
                       rows=rows, hint=FLOAT32_HINT)
    raise Feedback(f"{what} {mistake or 'is wrong'} on {ranks_phrase(wrong)}.", rows=rows, hint=hint)


def holds(claim: str, on_ranks: list[bool], hint: str = "") -> None:
    """Raise ``Feedback`` unless ``claim`` (a statement: "every rank wrote its own shard") is true on
    every rank: ``claim: not so on ranks 0, 1.``, where ``compare`` of booleans would say
    "expected True, got False"."""
    __tracebackhide__ = True
    wrong = [rank for rank, ok in enumerate(on_ranks) if ok is not True]
    if wrong:
        raise Feedback(f"{claim}: not so on {ranks_phrase(wrong)}.", hint=hint)


def passed(message: str) -> None:
    """The one fixed line a checker prints on success: ``Correct: message``."""
    print(Feedback.correct(message).render())
