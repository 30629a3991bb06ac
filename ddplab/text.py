"""Small text helpers shared by ddplab's messages."""

from __future__ import annotations


def plural(count: int, word: str) -> str:
    """``word`` as it reads after ``count`` of them: ``plural(1, "rank")`` is ``"rank"``, else ``"ranks"``."""
    return word if count == 1 else word + "s"


def replace_tracebacks(text: str, last_line: str, replacement: str) -> str:
    """``text`` with each Python traceback whose last line starts with ``last_line`` replaced by
    the line ``replacement``: a traceback that says nothing the reader needs, e.g. torchrun's
    own ``SignalException`` when ddplab itself ended it, would hide the lines that do.
    """
    out: list[str] = []
    start = None                                   # where in ``out`` the open traceback began
    for line in text.splitlines(keepends=True):
        if line.startswith("Traceback (most recent call last):"):
            start = len(out)
        out.append(line)
        if start is not None and not line.startswith((" ", "Traceback")):
            if line.startswith(last_line):
                out[start:] = [replacement + "\n"]
            start = None
    return "".join(out)


def shorten(text: str, limit: int, where: str) -> str:
    """``text`` if it has at most ``limit`` characters; else its start and its end, and a line
    in between saying how much was left out and ``where`` the whole of it is."""
    if len(text) <= limit:
        return text
    head, tail = text[:limit * 3 // 4], text[-(limit // 4):]
    left = len(text) - len(head) - len(tail)
    return f"{head}\n... ({left:,} characters left out here; the whole text is in {where}) ...\n{tail}"

