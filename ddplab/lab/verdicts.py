"""The words of a job's hang verdicts: one wording for the lab's jobs and for launched ones.

A job is code that makes its own process group and runs until it is done: on the lab's
ranks (``lab.spawn``, ``lab.run_script``: a ``HangError`` from ``ddplab.lab.stall``) or as
subprocesses (``ddplab.launch``, ``ddplab.train``'s launches: a ``LaunchError`` from
``ddplab.launch.failure``). Either way its timeout is a no-progress one, and the verdicts
read the same, so a student who met one knows the other:

- ``waited``: a rank sat a whole timeout in one torch.distributed call; that wait is the
  hang, whatever the others do;
- ``no_progress``: nothing moved for a whole timeout, and what that says;
- ``failed``: a process of the job exited with an error;
- a rank that waited for ranks which finished without the call is
  ``ddplab.lab.diagnose.peer_left``'s, for calls and jobs alike.

What the launcher adds (every process ended) is its own ``ended`` clause.
"""

from __future__ import annotations

from ..text import plural

#: What a launched job's verdicts add: the processes it started are gone.
ENDED = "every process it started was ended"


def waited(where: dict[int, str], timeout: float, ended: str = "") -> str:
    """Ranks that sat a whole ``timeout`` in one torch.distributed call, and where each is
    (``{0: "in barrier (train.py line 9)"}``; "" where it is not known)."""
    ranks = sorted(where)
    many = len(ranks) > 1
    known = all(where.values())
    at = "; ".join(f"rank {rank} {where[rank]}" for rank in ranks) if known else \
        f"{plural(len(ranks), 'rank')} {', '.join(map(str, ranks))}"
    call = "that torch.distributed call" if known else "one torch.distributed call"
    head = (f"ddplab: {at}: {'each has' if many else 'it has'} waited in {call} for "
            f"timeout={timeout:g} s without it finishing, and that wait is the hang, whatever the "
            f"other ranks do meanwhile (one computing, or in its own code, has not reached the "
            f"call, or never will)")
    return f"{head}; {ended}." if ended else f"{head}."


def no_progress(timeout: float, detail: str) -> str:
    """The job made no progress for a whole ``timeout``; ``detail`` says what the look found
    (``: every rank waits in communication ...``, `` (no output, no CPU time used); ...``)."""
    return f"ddplab: the job made no progress for timeout={timeout:g} s{detail}"


def failed(returncodes: list[int | None], ended: str = ENDED) -> str:
    """A process of the job exited with an error; ``returncodes`` by command (None: ended by
    ddplab after another failed)."""
    after = "; None: ended by ddplab after another failed" if None in returncodes else ""
    return f"ddplab: the job failed (exit codes {returncodes}{after}); {ended}."
