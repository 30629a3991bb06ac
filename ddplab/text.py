"""Small text helpers shared by ddplab's messages."""

from __future__ import annotations


def plural(count: int, word: str) -> str:
    """``word`` as it reads after ``count`` of them: ``plural(1, "rank")`` is ``"rank"``, else ``"ranks"``."""
    return word if count == 1 else word + "s"
