"""The exceptions ddplab raises, so notebooks and graders can catch them by type.

Every message starts with what went wrong, then what was expected, then the fix.
"""

from __future__ import annotations


class DdplabError(Exception):
    """Base class for every error ddplab raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the kernel-side stack: ddplab's
        # own frames say nothing to a student; the message (with each rank's
        # traceback) says it all.
        return [f"{type(self).__name__}: {self}"]


class ConfigError(DdplabError, ValueError):
    """Bad input to a ddplab call. Raised before any process starts."""


class RankError(DdplabError):
    """Code raised an exception on one or more ranks.

    ``failures`` maps each failing torch rank to its formatted traceback, so a
    test or a grader can look at one rank without parsing the message.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = dict(sorted(failures.items()))


class HangError(DdplabError):
    """Ranks did not finish within the timeout: usually a deadlock.

    ``states`` maps each rank to ``"finished"``, ``"failed"`` or
    ``"still running"``, ``where`` maps each stuck rank to a one-line location
    (for example ``"in send (cell line 3)"``), ``stacks`` to its Python stack and
    ``collectives`` to the collectives it is in or finished last (flight recorder).
    """

    def __init__(self, message: str, states: dict[int, str],
                 where: dict[int, str] | None = None, stacks: dict[int, str] | None = None,
                 collectives: dict[int, list[dict]] | None = None):
        super().__init__(message)
        self.states = dict(sorted(states.items()))
        self.where = dict(where or {})
        self.stacks = dict(stacks or {})
        #: Per rank, its latest collectives on each group from torch's flight
        #: recorder (``group``, ``seq``, ``op``, ``sizes``, ``active``), where read.
        self.collectives = dict(sorted((collectives or {}).items()))


class EngineDiedError(DdplabError):
    """A rank's engine process is gone (killed, or out of memory). ``ranks`` lists them;
    ``reason`` is the one sentence of the message that says why (the lab repeats it while
    it needs a restart)."""

    def __init__(self, message: str, ranks: list[int], reason: str = ""):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.reason = reason


class LaunchError(DdplabError):
    """A script ``ddplab.launch`` ran failed or did not finish in time. ``launch`` holds the details."""

    def __init__(self, message: str, launch: object):
        super().__init__(message)
        self.launch = launch


class CommandError(LaunchError, RuntimeError):
    """Commands ddplab ran side by side (``train.run_commands``) failed or ran out of time: a
    ``LaunchError`` (the same report, ``launch`` the details) that is also a ``RuntimeError``."""


class GradeError(DdplabError, ValueError):
    """The grading cannot start: a reference notebook is missing or unusable."""


class CourseError(DdplabError, ValueError):
    """No course notebooks where they should be, or no exercise of that name."""


class ReleaseError(DdplabError, ValueError):
    """A course notebook whose solution markers cannot be turned into a stub."""
