"""Compare a check cell's outputs with the reference's, and score each exercise.

An exercise passes when its exercise cell ran without error and its check
cell ran without error and printed what the reference printed, compared the
way nbval compares: nbval's own stream coalescing and sanitize-file parser,
``nbval_sanitize.cfg`` (beside this module) applied to both sides, the fields
nbval skips skipped. ``score`` turns the ``CellRun``s that ``ddplab.grade.run``
recorded into one ``Mark`` per exercise.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources

import nbformat

from .cells import CellRun, Exercise, describe

# Output fields that never match run to run; nbval skips the same ones
# (plus images, which it compares only with nbdime).
SKIP_COMPARE = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}


def sanitize_patterns() -> list[tuple[str, str]]:
    """The (regex, replacement) pairs of the sanitize file shipped with ddplab."""
    from nbval.plugin import get_sanitize_patterns
    text = resources.files("ddplab.grade").joinpath("nbval_sanitize.cfg").read_text()
    return get_sanitize_patterns(text)


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
    from nbval.plugin import coalesce_streams
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
    """One exercise of one submission."""
    exercise: str
    passed: bool
    reason: str = ""
    #: How long its exercise and check cells ran, in seconds (JUnit's time per test case).
    seconds: float = 0.0


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
        marks.append(Mark(ex.name, not why, why, spent))
    return marks


def _broken_before(steps: list[CellRun], check: CellRun) -> CellRun | None:
    """The first cell that is not an exercise or check and broke the kernel before ``check``."""
    for step in steps[:steps.index(check)]:
        if step.role == "other" and step.status in ("timeout", "died"):
            return step
    return None
