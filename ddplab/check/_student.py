"""The student's code as a check runs it: on the rank, and what the check says when it fails.

A checker runs the student's code on the ranks through ``run_student_code``
(``_core``); there ``call`` runs the checker's rank-side function, and when it
raises, notes on the exception, as one line of JSON, what the student needs:
the exception's name and message, the frames of the student's own code (never
ddplab's, torch's or Python's), and ddplab's advice for it (``rank`` used
inside a function, a rank that sent to itself). The exception goes on as it
was, so the lab's post-mortem debugger still has the real traceback, and the
note travels in the ``RankError`` the kernel receives.

``raised`` turns that ``RankError`` into the ``Feedback`` a student reads,
the way PrairieLearn's "friendly" pytest output does: the student's exception
first, by name and line, then their traceback alone::

    NameError: name 'rank' is not defined (Cell In[5], line 3, in swap), on ranks 0, 1.
    Your code's traceback (rank 0):
      Cell In[5], line 3, in swap
        other = 1 - rank
    The check ran swap with an input of shape [1] and dtype float32; it checks the answer once this runs.
    Hint: a function defined in the notebook kernel runs with the kernel's globals, ...

A refusal a check raised on the ranks (a forbidden collective, the reference
solution called) is a ``Feedback`` already: shown once, naming its ranks,
however many ranks raised it. ``hung`` does the same for a ``HangError``: where
each rank waits, and a hint that fits what the lab saw there.
"""

from __future__ import annotations

import json
import linecache
import logging
import traceback
from typing import Any, Callable

from ._feedback import Feedback, ranks_phrase

log = logging.getLogger(__name__)

#: The note's first words, on the line that carries it.
MARK = "ddplab-check: "
#: The student's frames shown: the innermost ones (a deep recursion needs no more).
FRAMES = 6
#: The longest exception message kept whole.
MESSAGE = 600


# ------------------------------------------------------------------ on a rank
def call(fn: Callable, *args: Any) -> Any:
    """On a rank: ``fn(*args)``; what it raises leaves with a note for the kernel (``describe``)."""
    try:
        return fn(*args)
    except Exception as exc:
        try:
            exc.add_note(MARK + json.dumps(describe(exc)))
        except Exception:                        # an exception whose notes cannot be set: no note
            log.debug("could not note %r", exc, exc_info=True)
        raise


def _theirs(filename: str) -> bool:
    from ddplab.rank.where import is_user_code

    return is_user_code(filename)


def describe(exc: BaseException) -> dict[str, Any]:
    """What the kernel needs of an exception raised by a check's code on a rank, as plain data."""
    from ddplab.rank.engine import advice

    if isinstance(exc, Feedback):
        return {"feedback": exc.as_dict()}
    frames = [[f.filename, f.lineno, f.name, (f.line or "").strip()]
              for f in traceback.extract_tb(exc.__traceback__) if _theirs(f.filename)]
    message = str(exc)
    if len(message) > MESSAGE:
        message = message[:MESSAGE] + " ..."
    return {"type": type(exc).__name__, "message": message, "frames": frames[-FRAMES:],
            "advice": advice(exc)}


# ------------------------------------------------------------------ in the kernel
def noted(text: str) -> dict[str, Any] | None:
    """The note ``call`` left in a rank's formatted traceback, or None if there is none."""
    for line in reversed(text.splitlines()):
        if line.startswith(MARK):
            try:
                found = json.loads(line[len(MARK):])
            except ValueError:
                return None
            return found if isinstance(found, dict) else None
    return None


def _place(filename: str, lineno: int, function: str) -> str:
    """``Cell In[5], line 3, in swap`` (IPython's name for a notebook cell) or ``file.py, line 3, in f``."""
    from ddplab.rank.where import CELL_PREFIX

    if filename.startswith(CELL_PREFIX):
        return f"your %%ranks cell, line {lineno}" + ("" if function == "<module>" else f", in {function}")
    label = None
    try:
        from IPython import get_ipython
        shell = get_ipython()
        if shell is not None:
            label = shell.compile.format_code_name(filename)
    except (ImportError, AttributeError):
        label = None
    where = " ".join(label) if label else filename.rsplit("/", 1)[-1]
    return f"{where}, line {lineno}" + ("" if function == "<module>" else f", in {function}")


def _source(filename: str, lineno: int, line: str) -> str:
    """The line's text: the rank's, else this kernel's copy of a notebook cell (the rank had none)."""
    return line or linecache.getline(filename, lineno).strip()


def _last_line(text: str) -> str:
    """The exception line a formatted traceback ends with (no note): what a rank without one raised."""
    lines = [line for line in text.strip().splitlines()
             if line.strip() and not line[0].isspace() and not line.startswith(MARK)]
    tail = [line for line in lines if not line.startswith(("Traceback", "ddplab: "))]
    return tail[-1] if tail else (lines[-1] if lines else "an error")


def raised(what: str, failures: dict[int, str], meanwhile: str = "") -> Feedback:
    """The ``Feedback`` for a ``RankError`` of a check (``failures``: each rank's traceback).

    A refusal (a ``Feedback`` raised on the ranks) is shown once with its ranks;
    otherwise the student's exception is the headline, with their own
    traceback, and ddplab's advice for it as the hint. ``meanwhile``: what the
    other ranks were doing (stuck waiting for the failed one), when the lab said.
    """
    notes = {rank: noted(text) for rank, text in sorted(failures.items())}
    refusals: dict[str, list[int]] = {}
    for rank, note in notes.items():
        if note and "feedback" in note:
            refusals.setdefault(json.dumps(note["feedback"], sort_keys=True), []).append(rank)
    if refusals:
        (first, ranks), *others = refusals.items()
        refusal = Feedback.from_dict(json.loads(first))
        also = [f"{ranks_phrase(r)}: {Feedback.from_dict(json.loads(f)).headline}" for f, r in others]
        return Feedback(f"{refusal.headline.rstrip('.')}, on {ranks_phrase(ranks)}.", rows=refusal.rows,
                        detail=[*refusal.detail, *also, *([meanwhile] if meanwhile else [])],
                        hint=refusal.hint)
    groups: dict[str, list[int]] = {}
    for rank, note in notes.items():
        groups.setdefault(_headline(note, failures[rank]), []).append(rank)
    (headline, ranks), *others = groups.items()
    detail = [f"{ranks_phrase(r)}: {h}" for h, r in others]
    note = notes[ranks[0]]
    detail += _traceback(note, failures[ranks[0]], f" (rank {ranks[0]})")
    detail.append(f"It raised while the check ran {what}.")
    if meanwhile:
        detail.append(meanwhile)
    return Feedback(f"{headline}, on {ranks_phrase(ranks)}.", detail=detail,
                    hint=" ".join((note or {}).get("advice", [])))


def answer_raised(what: str, described: dict[str, Any], hint: str = "") -> Feedback:
    """The ``Feedback`` for a plain function of the student's that raised when the check called it
    (``described``: ``describe``'s data, from wherever it ran). A refusal the check raised
    inside it (a ``Feedback``) is shown as it is."""
    if "feedback" in described:
        return Feedback.from_dict(described["feedback"])
    return Feedback(f"{_headline(described, '')}.",
                    detail=[*_traceback(described, "", ""), f"It raised when the check called {what}."],
                    hint=" ".join([*described.get("advice", []), hint]))


def _traceback(note: dict | None, text: str, whose: str) -> list[str]:
    """The student's frames, with their lines; without a note, the end of the rank's own text."""
    if not note:                 # no note (the rank failed outside the check's call): its last lines
        lines = [line for line in text.strip().splitlines() if not line.startswith("Traceback (")]
        return [f"  {line}" for line in lines[-8:]]
    frames = note.get("frames", [])
    lines = [f"Your code's traceback{whose}:"] if frames else []
    for filename, lineno, function, line in frames:
        lines.append(f"  {_place(filename, lineno, function)}")
        source = _source(filename, lineno, line)
        if source:
            lines.append(f"    {source}")
    return lines


def _headline(note: dict | None, text: str) -> str:
    """``NameError: name 'rank' is not defined (Cell In[5], line 3, in swap)``."""
    if not note:
        return _last_line(text).rstrip(".")
    said = f"{note['type']}: {note['message']}" if note.get("message") else note["type"]
    frames = note.get("frames", [])
    if frames:
        filename, lineno, function, _ = frames[-1]
        said += f" ({_place(filename, lineno, function)})"
    return said


def hung(what: str, exc: Any, timeout: float, hint: str) -> Feedback:
    """The ``Feedback`` for the student's code that hung (``exc``: the lab's ``HangError``).

    Where each rank waits; the hint opens with the lab's own for the pattern it
    saw (every rank in recv, every rank in send, ranks waiting for one that
    finished, a rank alone in DDP's constructor), so it never contradicts where
    the ranks are, then ``hint``, the checker's word on this exercise. A
    checker's hint therefore never claims where the ranks wait ("two blocking
    sends facing each other" was said while both ranks were in recv).
    """
    from ddplab.lab.diagnose import deadlock_hint

    where = [f"  rank {rank}: {'still ' + exc.where[rank] if rank in exc.where else state}"
             for rank, state in exc.states.items()]
    seen = deadlock_hint(exc.states, exc.where, exc.stacks).removeprefix("Hint: ")
    # Not "within {timeout} s": the lab says a hang as soon as it is sure (a rank that returned
    # while another waits for it), often well before the timeout.
    return Feedback(f"{what} did not finish: the ranks are waiting for each other (a deadlock).",
                    detail=where,
                    hint=" ".join(part for part in (seen, hint, "Then recover with: lab.restart()")
                                  if part))
