"""Cell magics: ``%%ranks`` runs a cell on every rank, ``%%rank 0 2`` on some.

They load with ``ddplab.start(...)`` or ``%load_ext ddplab``. Options::

    %%ranks --timeout 10          # HangError after 10 s instead of the lab's default
    %%rank 0 --grace 5            # return after 5 s if rank 0 is still blocked
    %%ranks --trace               # draw the cell's torch.distributed calls as a timeline
    %%ranks --trace tr            # ... and keep it in the variable tr (a ddplab.Trace)
                                  # (with %%rank, --trace waits for the cell's end: no grace)
    %%rank 1 --pdb                # stop rank 1 in pdb at the cell's first line; its prompt,
                                  # (Pdb rank 1), opens in the notebook (no grace either)
    %%rank 1 --debugpy            # rank 1 waits for VS Code to attach, then runs the cell
    %%ranks --debugpy 1           # ... the same, the cell on every rank (lab.debugpy)

and a line magic, ``%ddplab_debug [RANK]``: post-mortem pdb on the rank that
raised the last ``RankError`` (``lab.debug()``), like IPython's ``%debug``.

Output is grouped by rank, in rank order, under ``[rank N]`` labels, and an
error on any rank fails the cell (so nbval and graders see it).
"""

from __future__ import annotations

import contextlib
import shlex

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..errors import ConfigError
from .current_lab import current


def _parse(line: str, magic: str) -> tuple[list[int], dict]:
    ranks: list[int] = []
    options: dict[str, float] = {}
    try:
        words = shlex.split(line)
    except ValueError as e:              # an unclosed quote
        raise ConfigError(f"ddplab: %%{magic} {line.strip()} cannot be read ({e}). Close the "
                          f"quote, or write the ranks and options without quotes, e.g. "
                          f"%%{magic}{' 0' if magic == 'rank' else ''} --timeout 10.") from None
    while words:
        word = words.pop(0)
        if word == "--pdb":
            options["pdb"] = True
        elif word == "--debugpy":
            options["debugpy"] = True
        elif word == "--trace":
            options["trace"] = True
            if words and words[0].isidentifier():
                options["trace_name"] = words.pop(0)
        elif word == "--grace" and magic == "ranks":
            raise ConfigError("ddplab: %%ranks does not take --grace: a cell on every rank "
                              "always runs to its end (or --timeout). --grace belongs to "
                              "%%rank N, which may leave a rank running.")
        elif word in ("--timeout", "--grace"):
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
                f"{' [--grace SECONDS]' if magic == 'rank' else ''} [--trace [NAME]] [--pdb] "
                f"[--debugpy{' [RANKS]' if magic == 'ranks' else ''}].")
    return ranks, options


@magics_class
class RankMagics(Magics):
    """The ``%%ranks`` and ``%%rank`` cell magics."""

    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run this cell on every rank of the current lab."""
        ranks, options = _parse(line, "ranks")
        if ranks and not options.get("debugpy"):
            raise ConfigError(f"ddplab: %%ranks runs on every rank and takes no rank numbers; "
                              f"use %%rank {' '.join(map(str, ranks))} to pick ranks.")
        lab = current()
        if options.get("debugpy"):       # the ranks named are the ones VS Code attaches to
            lab.check_ranks(ranks or None, spelled=f"%%ranks --debugpy {' '.join(map(str, ranks))}")
        with _attached(lab, options, ranks or None), _traced(lab, options, None, self.shell):
            lab.run_cell(cell, timeout=options.get("timeout"), pdb=options.get("pdb", False))

    @cell_magic
    def rank(self, line: str, cell: str) -> None:
        """Run this cell on the ranks named, e.g. ``%%rank 0`` or ``%%rank 0 2``."""
        ranks, options = _parse(line, "rank")
        lab = current()
        if not ranks:
            raise ConfigError("ddplab: %%rank needs the ranks to run on, e.g. %%rank 0 "
                              "(or %%ranks for all of them).")
        lab.check_ranks(ranks, spelled=f"%%rank {' '.join(map(str, ranks))}")
        # A trace or a debugger session lasts until the cell ends: no grace.
        waits = options.get("trace") or options.get("pdb") or options.get("debugpy")
        grace = None if waits else options.get("grace", lab.spec.grace)
        with _attached(lab, options, ranks), _traced(lab, options, ranks, self.shell):
            lab.run_cell(cell, ranks=ranks, timeout=options.get("timeout"), grace=grace,
                         pdb=options.get("pdb", False))

    @line_magic
    def ddplab_debug(self, line: str) -> None:
        """Post-mortem pdb on the rank of the last ``RankError`` (or ``%ddplab_debug 1``)."""
        words = line.split()
        if len(words) > 1 or (words and not words[0].isdigit()):
            raise ConfigError(f"ddplab: %ddplab_debug takes at most one rank number, but got "
                              f"{line.strip()!r}. Use %ddplab_debug, or %ddplab_debug 1.")
        lab = current()
        rank = int(words[0]) if words else None
        if rank is not None:
            lab.check_ranks([rank], spelled=f"%ddplab_debug {rank}")
        lab.debug(rank)


def _attached(lab, options: dict, ranks):
    """With ``--debugpy``: the cell inside ``lab.debugpy(ranks)`` (VS Code attached first)."""
    return lab.debugpy(ranks) if options.get("debugpy") else contextlib.nullcontext()


@contextlib.contextmanager
def _traced(lab, options: dict, ranks, shell):
    """With ``--trace [NAME]``: record the cell on its ranks, show the timeline, keep it as NAME."""
    if not options.get("trace"):
        yield
        return
    from IPython.display import display
    trace = lab.trace(ranks)
    try:
        with trace:
            yield
    finally:
        if trace.collected:
            if options.get("trace_name") and shell is not None:
                shell.user_ns[options["trace_name"]] = trace
            display(trace)


def load_ipython_extension(shell) -> None:
    """``%load_ext ddplab`` calls this; ``ddplab.start`` does too."""
    shell.register_magics(RankMagics)


def register() -> None:
    """Load the magics into the IPython running this code, if any (starting a lab calls this)."""
    from IPython import get_ipython
    shell = get_ipython()
    if shell is not None:
        load_ipython_extension(shell)
