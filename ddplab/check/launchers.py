"""Checkers for notebook exercises (see _core for the shared behaviour)."""

from __future__ import annotations

__all__: list[str] = []
