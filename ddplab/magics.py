"""Cell magics: ``%%ranks`` runs a cell on every rank, ``%%rank 0 2`` on some.

They load with ``ddplab.start(...)`` or ``%load_ext ddplab``. Options::

    %%ranks --timeout 10          # HangError after 10 s instead of the lab's default
    %%rank 0 --grace 5            # return after 5 s if rank 0 is still blocked

Output is grouped by rank, in rank order, under ``[rank N]`` labels, and an
error on any rank fails the cell (so nbval and graders see it).
"""

from __future__ import annotations

import shlex

from IPython.core.magic import Magics, cell_magic, magics_class

from .errors import ConfigError


def _parse(line: str, magic: str) -> tuple[list[int], dict[str, float]]:
    ranks: list[int] = []
    options: dict[str, float] = {}
    words = shlex.split(line)
    while words:
        word = words.pop(0)
        if word in ("--timeout", "--grace"):
            if not words:
                raise ConfigError(f"ddplab: %%{magic} {word} needs a number of seconds, "
                                  f"e.g. %%{magic} {word} 10.")
            value = words.pop(0)
            try:
                options[word[2:]] = float(value)
            except ValueError:
                raise ConfigError(f"ddplab: %%{magic} {word} needs a number of seconds, "
                                  f"but got {value!r}. Use e.g. {word} 10.") from None
        elif word.lstrip("-").isdigit() and not word.startswith("--"):
            ranks.append(int(word))
        else:
            raise ConfigError(
                f"ddplab: %%{magic} does not understand {word!r}. "
                f"Use %%{magic}{' 0 1' if magic == 'rank' else ''} [--timeout SECONDS]"
                f"{' [--grace SECONDS]' if magic == 'rank' else ''}.")
    return ranks, options


@magics_class
class RankMagics(Magics):
    """The ``%%ranks`` and ``%%rank`` cell magics."""

    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run this cell on every rank of the current lab."""
        from .cluster import current
        ranks, options = _parse(line, "ranks")
        if ranks:
            raise ConfigError(f"ddplab: %%ranks runs on every rank and takes no rank numbers; "
                              f"use %%rank {' '.join(map(str, ranks))} to pick ranks.")
        current().run_cell(cell, timeout=options.get("timeout"))

    @cell_magic
    def rank(self, line: str, cell: str) -> None:
        """Run this cell on the ranks named, e.g. ``%%rank 0`` or ``%%rank 0 2``."""
        from .cluster import current
        ranks, options = _parse(line, "rank")
        lab = current()
        if not ranks:
            raise ConfigError("ddplab: %%rank needs the ranks to run on, e.g. %%rank 0 "
                              "(or %%ranks for all of them).")
        lab.check_ranks(ranks, spelled=f"%%rank {' '.join(map(str, ranks))}")
        lab.run_cell(cell, ranks=ranks, timeout=options.get("timeout"),
                     grace=options.get("grace", lab.spec.grace))


def load_ipython_extension(shell) -> None:
    """``%load_ext ddplab`` calls this; ``ddplab.start`` does too."""
    shell.register_magics(RankMagics)
