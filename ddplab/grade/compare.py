"""Compare a check cell's outputs with the reference's, and score each exercise.

An exercise passes when its exercise cell ran without error and its check
cell ran without error and printed what the reference printed, compared the
way nbval compares: nbval's own rules for streams and markers (``nbval_rules``),
``nbval_sanitize.cfg`` (beside this module) applied to both sides, the fields
nbval skips skipped. ``score`` turns the ``CellRun``s that ``ddplab.grade.run``
recorded into one ``Mark`` per exercise.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources

import nbformat

from ..errors import GradeError
from .cells import CellRun, Exercise, describe
from .nbval_rules import coalesce_streams, find_comment_markers, find_metadata_tags, sanitize_pairs

# Output fields that never match run to run; nbval skips the same ones
# (plus images, which it compares only with nbdime).
SKIP_COMPARE = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}


def require_nbval(command: str) -> None:
    """Refuse ``command`` now, with the fix, where nbval is missing: a student's install has
    none (``pip install ddplab``: nbval brings pytest), the ``grade`` and ``instructor``
    extras have it. Grading without it would fail at the first comparison."""
    if importlib.util.find_spec("nbval") is None:
        raise GradeError(f"ddplab {command}: grading compares outputs with nbval, which this "
                         f"installation lacks (a student's install leaves the instructor tools "
                         f"out). Install them: pip install 'ddplab[grade]' (or 'ddplab[instructor]'; "
                         f"in a checkout, make lab-reference).")


def sanitize_patterns() -> list[tuple[str, str]]:
    """The (regex, replacement) pairs of the sanitize file shipped with ddplab."""
    text = resources.files("ddplab.grade").joinpath("nbval_sanitize.cfg").read_text()
    return sanitize_pairs(text)


def sanitize(value, patterns):
    if not isinstance(value, str):
        return value
    for regex, replacement in patterns:
        value = re.sub(regex, replacement, value)
    return value


def comparable(outputs: list, patterns) -> dict[str, list]:
    """Outputs in nbval's comparison form: per field (stream name, MIME type), the sanitized values.

    Unlike nbval, a stream that sanitizes to nothing (a torch warning line on
    stderr) counts as no output at all.
    """
    flat: dict[str, list] = defaultdict(list)
    for out in coalesce_streams([nbformat.from_dict(copy.deepcopy(o)) for o in outputs]):
        if out.output_type == "stream":
            text = sanitize(out.text, patterns)
            if text.strip():
                flat[out.name].append(text)
            continue
        for key, value in out.items():
            if key == "data":
                for mime, data in value.items():
                    if mime not in SKIP_COMPARE:
                        flat[mime].append(sanitize(data, patterns))
            elif key not in SKIP_COMPARE:
                flat[key].append(sanitize(value, patterns))
    return dict(flat)


def values_compared(cell) -> bool:
    """Whether nbval compares this code cell's outputs (not marked ``# NBVAL_IGNORE_OUTPUT`` or
    tagged ``nbval-ignore-output``; a comment wins over a tag, as in nbval)."""
    options = dict(find_metadata_tags(cell.get("metadata", {})))
    options.update(find_comment_markers(cell.get("source", "")))
    return options.get("check", True)


def digest(outputs: list, patterns, values: bool = True) -> str:
    """A short fingerprint of ``outputs``: equal for two runs whose outputs nbval calls the same.

    It sums each output's kind (its type and stream name or MIME types, so a
    picture counts though its pixels are never compared) and, as
    ``comparable`` gives them, its sanitized values. ``values=False`` is for a
    cell nbval does not compare (``values_compared``): its numbers are left
    out, and the spaces that pad them into columns, since a timing or a
    bandwidth differs run to run while what is printed around it does not.
    ``ddplab release`` keeps a cell's outputs in the student copy only where a
    run of that copy gave the same digest (``ddplab.course.release``).
    """
    kinds = []
    for out in coalesce_streams([nbformat.from_dict(copy.deepcopy(o)) for o in outputs]):
        if out.output_type == "stream":
            if sanitize(out.text, patterns).strip():
                kinds.append(["stream", out.name])
        elif out.output_type == "error" or out.get("data"):
            # a live output area ends empty (ddplab.lab.live): nothing shown, nothing compared
            kinds.append([out.output_type, *sorted(out.get("data", {}))])
    flat = comparable(outputs, patterns)
    if not values:
        flat = {key: [_without_numbers(v) if isinstance(v, str) else v for v in found]
                for key, found in flat.items()}
    text = json.dumps([kinds, flat], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_numbers(text: str) -> str:
    """``text`` with each number (``104,488``, ``9.38``, ``1e-12``) a ``0`` and each run of spaces one."""
    return re.sub(r"[ \t]+", " ", re.sub(r"[-+]?\d[\d,.]*(?:[eE][-+]?\d+)?", "0", text))


def difference(expected: list, got: list, patterns) -> str:
    """'' if ``got`` matches ``expected`` the way nbval compares them, else a short description."""
    want, have = comparable(expected, patterns), comparable(got, patterns)
    if want == have:
        return ""
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            return (f"output differs from the reference: expected {_first_line(want.get(key))}, "
                    f"got {_first_line(have.get(key))}")
    return "output differs from the reference"


def _first_line(values) -> str:
    if not values:
        return "nothing"
    text = str(values[0]).strip().splitlines() or [""]
    line = text[0] if len(text[0]) <= 70 else text[0][:67] + "..."
    return repr(line) + (" ..." if len(text) > 1 or len(values) > 1 else "")


@dataclass
class Mark:
    """One exercise of one submission: ``reason`` why it was lost (a check's whole feedback, as the
    notebook shows it), or ``output``, what its check printed when it passed (its ``Correct:`` line)."""
    exercise: str
    passed: bool
    reason: str = ""
    #: How long its exercise and check cells ran, in seconds (JUnit's time per test case).
    seconds: float = 0.0
    #: A passed check's printed lines (its pass line), for JUnit and Gradescope.
    output: str = ""


def score(steps: list[CellRun], found: list[Exercise], problems: dict[str, str],
          patterns) -> list[Mark]:
    """Per exercise: passed, or the first reason it did not."""
    marks = []
    for ex in found:
        exercise = next((s for s in steps if s.role == "exercise" and s.name == ex.name), None)
        check = next(s for s in steps if s.role == "check" and s.name == ex.name)
        outcome = (check.error if check.status != "ok" else
                   difference(ex.check.get("outputs", []), check.outputs, patterns))
        if ex.name in problems:
            ran = "it failed" if outcome else "it passed"
            why = f"{problems[ex.name]} (the reference check ran anyway: {ran})"
        elif exercise.status != "ok":
            why = f"exercise cell: {exercise.error}"
        else:
            why = f"check: {outcome}" if outcome else ""
        broke = _broken_before(steps, check)
        if why and broke is not None:
            # A set-up cell that timed out leaves the kernel without `ddplab`:
            # say that, not only the NameError it caused.
            why = f"{describe(broke)}: {broke.error}, so the cells after it ran without it; {why}"
        spent = check.seconds + (exercise.seconds if exercise is not None else 0.0)
        marks.append(Mark(ex.name, not why, why, spent, "" if why else _printed(check.outputs)))
    return marks


def _printed(outputs: list) -> str:
    """What a check cell printed on stdout (a passing check: its one ``Correct:`` line)."""
    return "".join(str(o.get("text", "")) for o in outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stdout").strip()


def _broken_before(steps: list[CellRun], check: CellRun) -> CellRun | None:
    """The first cell that is not an exercise or check and broke the kernel before ``check``."""
    for step in steps[:steps.index(check)]:
        if step.role == "other" and step.status in ("timeout", "died"):
            return step
    return None
