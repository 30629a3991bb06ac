"""What a failed launch says: ``LaunchError``'s message, from the ``Launch`` it carries.

First what went wrong: a rank that waited a whole timeout in one torch.distributed call
(``Launch.waited``), a launch that made no progress, or one whose processes failed; and
a failure that is gloo's "Connection closed by peer" after another rank finished names
that rank as the one that left without the call. Then what was launched, each rank's last
lines, the launcher's, and the fix. Also ``command_line``: a launch as you would type it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ..lab import diagnose

if TYPE_CHECKING:
    from . import Launch


def command_line(launch: Launch, index: int = 0) -> str:
    """A launch's command as you would type it in the script's folder (``torchrun`` for
    ``python -m torch.distributed.run``)."""
    words = list(launch.commands[index])
    if words[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    elif words[0] == sys.executable:
        words[0] = "python"
    # A script's folder differs per run (often a temporary one): show its name only.
    return " ".join(os.path.basename(w) if os.path.isabs(w) else w for w in words)


def message(result: Launch, timeout: float) -> str:
    what = "\n  ".join(command_line(result, i) for i in range(len(result.commands)))
    if result.waited:
        ranks = sorted(result.waited)
        many = len(ranks) > 1
        where = "; ".join(f"rank {rank} {result.waited[rank]}" for rank in ranks)
        head = (f"ddplab: {where}: {'each has' if many else 'it has'} waited in that "
                f"torch.distributed call for timeout={timeout:g} s without it finishing, and that "
                f"wait is the hang, whatever the other ranks do meanwhile (one computing, or in "
                f"its own code, has not reached the call, or never will); every process the "
                f"launch started was ended.")
        fix = "Fix the script (every rank makes the same calls), or give it longer: timeout=..."
    elif result.timed_out:
        head = (f"ddplab: the launch made no progress for timeout={timeout:g} s (no output, no CPU "
                f"time used); every process it started was ended. The ranks are probably waiting "
                f"for each other (or for a rank that never started).")
        fix = "Fix the script, or give it longer: timeout=..."
    else:
        ended = "; None: ended by ddplab after another failed" if None in result.returncodes else ""
        head = (f"ddplab: the launch failed (exit codes {result.returncodes}{ended}); every "
                f"process it started was ended.")
        fix = "Fix the error shown above in the script, then launch again."
        left = _left_early(result)
        if left:
            head, fix = f"{left}\n{head}", "Fix the script, then launch again."
    lines = [head, f"Launched:\n  {what}"]
    for rank, text in sorted(result.rank_output.items()):
        lines.append(f"--- rank {rank} ---\n{_tail(text, 15)}")
    lines.append(f"--- launcher output (last lines) ---\n{_tail(result.launcher_output, 20)}")
    lines.append(fix)
    return "\n".join(lines)


def _left_early(result: Launch) -> str:
    """When every rank that failed did so because gloo's peer closed the connection while it
    waited in a torch.distributed call, and other ranks exited with 0: the verdict that those
    left without making the call (``lab.diagnose.peer_left``); "" otherwise."""
    codes = dict(enumerate(result.returncodes))
    if len(codes) != len(result.rank_output):       # one launcher for many ranks: no codes by rank
        codes = {rank: 0 if "Traceback (most recent" not in text else 1
                 for rank, text in result.rank_output.items()}
    failed = {rank: diagnose.waited_when_peer_left(result.rank_output.get(rank, ""))
              for rank, code in codes.items() if code not in (0, None)}
    exited = sorted(rank for rank, code in codes.items() if code == 0)
    return diagnose.peer_left(failed, exited, "finished") if all(failed.values()) else ""


def _tail(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:]) or "(nothing)"
