"""nbval's rules for reading a notebook, spelled here so that ddplab needs no nbval to apply them.

``make test`` and ``ddplab grade`` compare outputs with nbval, and a student copy keeps a
cell's outputs only where a stub run printed the same as nbval would see it
(``ddplab.course.release``). A student's install (``pip install ddplab``) has no nbval (it
brings pytest), yet ``ddplab notebooks`` and ``ddplab release`` must read the notebooks as
nbval does: which cells a comment or tag marks (``# NBVAL_IGNORE_OUTPUT``,
``raises-exception``), how streams are merged before comparing, and the sanitize file's pairs.
These are nbval 0.11's own definitions (``nbval/plugin.py``); ``tests/test_nbval_rules.py``
holds them against nbval's, so a new nbval that reads notebooks otherwise fails there first.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["coalesce_streams", "comment_markers", "find_comment_markers", "find_metadata_tags",
           "metadata_tags", "sanitize_pairs"]

#: A comment line in a cell -> the option it sets (``(option, value)``, or ``option`` for True).
comment_markers = {
    "PYTEST_VALIDATE_IGNORE_OUTPUT": ("check", False),
    "NBVAL_IGNORE_OUTPUT": ("check", False),
    "NBVAL_CHECK_OUTPUT": "check",
    "NBVAL_RAISES_EXCEPTION": "check_exception",
    "NBVAL_SKIP": "skip",
}
#: A cell tag -> the option it sets, as ``comment_markers``.
metadata_tags = {
    "pytest-validate-ignore-output": ("check", False),
    "nbval-ignore-output": ("check", False),
    "nbval-check-output": "check",
    "nbval-raises-exception": "check_exception",
    "nbval-skip": "skip",
    "raises-exception": "check_exception",
}
_CARRIAGE_RETURN = re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)
_PAIR = re.compile(r"^regex: (.*)$\n^replace: (.*)$", re.MULTILINE)


def _options(names: list[str], table: dict) -> Iterator[tuple[str, bool]]:
    for name in names:
        if name in table:
            marker = table[name]
            yield marker if isinstance(marker, tuple) else (marker, True)


def find_comment_markers(source: str) -> Iterator[tuple[str, bool]]:
    """The ``(option, value)`` pairs a cell's comment lines set (the last of two wins)."""
    comments = [line.strip().lstrip("#").strip() for line in source.splitlines()
                if line.strip().startswith("#")]
    return _options(comments, comment_markers)


def find_metadata_tags(metadata: dict) -> Iterator[tuple[str, bool]]:
    """The ``(option, value)`` pairs a cell's tags set; none where ``tags`` is not a list."""
    tags = metadata.get("tags")
    return _options(tags if isinstance(tags, list) else [], metadata_tags)


def coalesce_streams(outputs: list) -> list:
    """``outputs`` with each stream's pieces merged into its first (in place, as nbval does), and
    a line's text before a carriage return that is not the line's end removed (a progress
    bar's redraws: what a terminal would overwrite)."""
    if not outputs:
        return outputs
    merged, streams = [], {}
    for output in outputs:
        if output.output_type == "stream" and output.name in streams:
            streams[output.name].text += output.text
            continue
        if output.output_type == "stream":
            streams[output.name] = output
        merged.append(output)
    for output in streams.values():
        # nbval means to cancel a character before a backspace too, but its loop starts with
        # equal lengths and never runs; as nbval compares, backspaces stay.
        output.text = _CARRIAGE_RETURN.sub("", output.text)
    return merged


def sanitize_pairs(text: str) -> list[tuple[str, str]]:
    """The ``(regex, replacement)`` pairs of a sanitize file's text: one ``regex:`` line, then one
    ``replace:`` line (a pair whose ``replace:`` lost its space is skipped, as nbval skips it)."""
    return _PAIR.findall(text)
