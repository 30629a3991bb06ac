"""The one kind of feedback every check gives: a headline, a table by rank, a hint.

A check that fails raises a ``Feedback``; one that passes prints its pass line
(``Feedback.correct``). Checkers build them and never lay out text themselves,
so the notebook, ``ddplab grade``'s report, the CSV, JUnit, Gradescope and
nbgrader all show the same words (as Pedal keeps feedback as data, resolved
for each place it is shown)::

    token is wrong on rank 1.                       <- the headline: names the mistake
      rank 0: expected [3.0] (float32)              <- the table: per rank, expected and got
              got      [3.0] (float32)
      rank 1: expected [1.0] (float32)
              got      [0.0] (float32)   <-- wrong
    Hint: rank r > 0 receives from (r - 1) % ...   <- the hint: a nudge, never the answer

Between table and hint may come ``detail`` lines: the student's own traceback
(``ddplab.check._student``), where each rank was stuck in a deadlock.

It is an ``AssertionError``, so nbval, nbgrader and ``ddplab grade`` see a
failed cell; in a notebook it renders as that one block, without the stack of
ddplab's checker code above it (IPython asks an exception for
``_render_traceback_`` before it formats one, as ``ddplab.errors`` does for
its own errors). ``str(feedback)`` is the same text: what a grader that only
has the exception's message (the error output's ``evalue``) shows.

Never the answer: a row may leave out what was expected (``Row.expected`` is
None) where that value is what the student must produce; each checker's
docstring says what its table shows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

#: The first words of every pass line (stored in the notebooks: nbval compares them).
PASSED = "Correct: "
#: The first word of the hint line.
HINT = "Hint: "
#: How a wrong row of the table is marked.
WRONG = "   <-- wrong"


@dataclass(frozen=True)
class Row:
    """One rank's line of the table: what it should have held and what it held.

    ``rank``: a rank, or a label for a row that is not one rank's ("all").
    ``expected``: the words for the right value, or None where showing it would
    give the answer away (the row then shows only what came). ``note``: a line
    under the row, on what this row's mistake usually is.
    """

    rank: int | str
    got: str
    expected: str | None = None
    wrong: bool = False
    note: str = ""

    def lines(self) -> list[str]:
        label = f"rank {self.rank}" if isinstance(self.rank, int) else str(self.rank)
        mark = WRONG if self.wrong else ""
        if self.expected is None:
            out = [f"  {label}: got {self.got}{mark}"]
        else:
            out = [f"  {label}: expected {self.expected}",
                   f"  {' ' * len(label)}  got      {self.got}{mark}"]
        return out + ([f"      {self.note}"] if self.note else [])


class Feedback(AssertionError):
    """What a check says: ``headline`` (names the mistake, or the pass), ``rows``, ``detail``, ``hint``.

    Raise it for a failure; ``Feedback.correct(message)`` is a pass, whose
    ``render()`` is the one fixed line a passing check prints.
    """

    def __init__(self, headline: str, *, rows: Iterable[Row] = (), detail: Iterable[str] | str = (),
                 hint: str = "", passed: bool = False) -> None:
        self.headline = " ".join(headline.split())        # one line: a report's reason is this line
        self.rows = tuple(rows)
        self.detail = tuple(detail.splitlines() if isinstance(detail, str) else detail)
        self.hint = hint.strip()
        self.passed = passed
        super().__init__(self.render())

    @classmethod
    def correct(cls, message: str) -> Feedback:
        """The pass: rendered as ``Correct: message``."""
        return cls(message, passed=True)

    def lines(self) -> list[str]:
        """The text, line by line: the headline, the table, the detail, the hint."""
        if self.passed:
            return [PASSED + self.headline]
        out = [self.headline]
        for row in self.rows:
            out += row.lines()
        out += list(self.detail)
        if self.hint:
            out.append(HINT + self.hint)
        return out

    def render(self) -> str:
        """The text every place shows: the notebook, the grade report, Gradescope, the CSV."""
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.render()

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the stack: the frames above are ddplab's
        # checker code, which tells a student nothing the headline does not.
        return self.lines()

    def __reduce__(self) -> tuple:
        return (_rebuild, (self.as_dict(),))

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON): how a rank hands a refusal it raised to the kernel."""
        return {"headline": self.headline, "rows": [asdict(row) for row in self.rows],
                "detail": list(self.detail), "hint": self.hint, "passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Feedback:
        return cls(data["headline"], rows=[Row(**row) for row in data.get("rows", ())],
                   detail=data.get("detail", ()), hint=data.get("hint", ""),
                   passed=bool(data.get("passed", False)))


def _rebuild(data: dict[str, Any]) -> Feedback:
    return Feedback.from_dict(data)


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    ranks = list(ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"


# ------------------------------------------------------------------ values, spelled
#: A tensor with more elements than this is spelled by its shape, and compared by its values.
SHOWN_ELEMENTS = 12


def _dtype(value: Any) -> str:
    return str(value.dtype).replace("torch.", "")


def spell(value: Any) -> str:
    """A value as a table shows it: a small tensor by its elements and dtype, a large one by shape."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() <= SHOWN_ELEMENTS:
            return f"{value.tolist()} ({_dtype(value)})"
        return f"a tensor of shape {list(value.shape)} ({_dtype(value)})"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        inner = ", ".join(spell(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def spell_against(expected: Any, got: Any) -> str:
    """``got`` as it differs from ``expected``: for two large tensors of one shape, by their values
    (how many elements differ, by how much, and the first one), never by their shapes alone."""
    import torch

    if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
            and expected.shape == got.shape and expected.numel() > SHOWN_ELEMENTS
            and expected.dtype.is_floating_point and got.dtype.is_floating_point):
        return spell(got)
    gap = (got.double() - expected.double()).abs().nan_to_num(nan=float("inf"))
    differ = gap > 0
    count = int(differ.sum())
    if not count:
        return f"the same values ({_dtype(got)})"
    first = [int(i) for i in differ.nonzero()[0]]
    at = tuple(first)
    return (f"{count} of {got.numel()} elements differ, by up to {float(gap.max()):.3g}; the first "
            f"at {first}: {float(got[at]):.6g} where {float(expected[at]):.6g} ({_dtype(got)})")


def float32_rounding(expected: Any, got: Any) -> bool:
    """Whether ``got`` is ``expected`` computed in float32 somewhere: a float64 answer off by no
    more than float32's rounding (a few parts in 10^7 of the values' size, grown by a few
    operations), but off by more than float64's own."""
    import torch

    if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
            and expected.dtype == torch.float64 and got.dtype.is_floating_point
            and expected.shape == got.shape and expected.numel() > 0):
        return False
    if not (torch.isfinite(expected).all() and torch.isfinite(got).all()):
        return False
    scale = max(float(expected.abs().max()), 1e-30)
    gap = float((got.double() - expected).abs().max())
    return 1e-12 * scale < gap <= 1e-4 * scale
