"""Every argument of ``ddplab.plan`` checked before any work, each refusal naming the fix.

A plan starts child processes that trace for a minute; an argument that cannot work
(``efficiency=0``, ``world_sizes=8``, ``strategies="ddp"``) is refused here, at once,
with what was expected, never found after the tracing (or never: a NaN step time that
``advice()`` would call the fastest).
"""

from __future__ import annotations

import math
import os
from numbers import Real
from typing import Any, Iterable

from ..errors import ConfigError
from .strategies import Strategy, parse

__all__ = ["alpha_beta", "efficiency", "output_path", "strategies", "timeout", "world_sizes"]


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def efficiency(value: Any) -> float:
    """The share of the device's peak FLOP/s a step reaches: in (0, 1]."""
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"ddplab.plan: efficiency is the share of the device's peak FLOP/s a step "
                          f"reaches, a number in (0, 1] such as 0.4; got {value!r}.")
    if value > 1:
        hint = f" Did you mean {value / 100:.2f}?" if value <= 100 else ""
        raise ConfigError(f"ddplab.plan: efficiency={value!r} is more than the device's peak: it is a "
                          f"share in (0, 1], not a percentage.{hint}")
    return float(value)


def world_sizes(value: Any) -> list[int]:
    """A non-empty list of distinct positive ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"ddplab.plan: world_sizes is a list of rank counts such as [8, 64, 1024]; "
                          f"got {value!r}" + (f": write [{value}]." if _number(value) else "."))
    sizes = list(value)
    if not sizes:
        raise ConfigError("ddplab.plan: world_sizes is empty: give at least one rank count, e.g. [8].")
    for n in sizes:
        if type(n) is not int and not (hasattr(n, "__index__") and not isinstance(n, (bool, float))):
            raise ConfigError(f"ddplab.plan: world_sizes holds {n!r} ({type(n).__name__}); each is a "
                              f"whole number of ranks, e.g. [8, 64]" + (f": write {int(n)} without quotes."
                                                                        if isinstance(n, str) and n.isdigit()
                                                                        else "."))
        if n < 1:
            raise ConfigError(f"ddplab.plan: world_sizes holds {n}; a world has 1 rank or more.")
    sizes = [int(n) for n in sizes]
    twice = sorted({n for n in sizes if sizes.count(n) > 1})
    if twice:
        raise ConfigError(f"ddplab.plan: world_sizes gives {', '.join(map(str, twice))} twice; "
                          f"give each once.")
    return sizes


def strategies(value: Any) -> list[Strategy]:
    """A non-empty list of strategies, each read strictly, none twice."""
    if isinstance(value, (str, Strategy)):
        raise ConfigError(f"ddplab.plan: strategies is a list of strategies; got the single "
                          f"{value if isinstance(value, str) else value.name!r}: write "
                          f"[{(value if isinstance(value, str) else value.name)!r}].")
    if not isinstance(value, Iterable):
        raise ConfigError(f"ddplab.plan: strategies is a list such as ['ddp', 'fsdp', 'tp8+fsdp']; "
                          f"got {value!r}.")
    chosen = [parse(s) for s in value]
    if not chosen:
        raise ConfigError("ddplab.plan: strategies is empty: give at least one, e.g. ['fsdp'].")
    names = [s.name for s in chosen]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"ddplab.plan: strategies names {', '.join(twice)} twice (the parts in another "
                          f"order are the same strategy); give each once.")
    return chosen


def alpha_beta(fit: Any, where: str = "ddplab.plan: network") -> tuple[float, float]:
    """α (s per message) and β (s per byte) of a fit: finite numbers >= 0."""
    if not isinstance(fit, dict):
        raise ConfigError(f"{where} is a name, a Network or a dict with 'alpha' and 'beta' (as "
                          f"ddplab.bench.fit_ring returns); got {fit!r}.")
    missing = [k for k in ("alpha", "beta") if k not in fit]
    if missing:
        raise ConfigError(f"{where} dict has no {' and no '.join(map(repr, missing))}: it needs 'alpha' "
                          f"(seconds per message) and 'beta' (seconds per byte), as "
                          f"ddplab.bench.fit_ring(results) returns.")
    values = []
    for key in ("alpha", "beta"):
        v = fit[key]
        if not _number(v) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{where}: {key} must be a finite number >= 0 (seconds per "
                              f"{'message' if key == 'alpha' else 'byte'}), got {v!r}. Take both from "
                              f"ddplab.bench.fit_ring(results).")
        values.append(float(v))
    return values[0], values[1]


def timeout(value: Any) -> float:
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"ddplab.plan: timeout is the seconds the tracing may take, a number > 0; "
                          f"got {value!r}.")
    return float(value)


def output_path(path: str) -> str:
    """A file that can be written, checked before the work that fills it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"ddplab.plan: {path!r} is a folder; give a file name such as plan.png.")
    if not os.path.isdir(folder):
        raise ConfigError(f"ddplab.plan: cannot save to {path!r}: the folder {folder!r} does not exist.")
    existed = os.path.exists(path)
    try:                                 # asked by writing: os.access says yes to root even in /proc
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ConfigError(f"ddplab.plan: cannot save to {path!r}: {e.strerror.lower()}; give a path "
                          f"you may write, e.g. in your home folder.") from e
    if not existed:
        os.remove(path)
    return path
