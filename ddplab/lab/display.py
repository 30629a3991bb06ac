"""Replay each rank's recorded output in the kernel, grouped by rank, in rank order.

Raw ``%%px`` prints output as it arrives, so two runs of one cell can differ.
ddplab records each rank's output in order on the rank (see ``engine.py``) and
replays it here only once the cell is done, under a ``[rank N]`` label, rank 0
first. The stored notebook output is then the same on every run.
"""

from __future__ import annotations

import sys


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (rich display, display ids), not a terminal."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _write(stream_name: str, text: str) -> None:
    # Flush the other stream first: ipykernel buffers stdout and stderr
    # separately, and without this their order in the notebook could flip.
    other = sys.stderr if stream_name == "stdout" else sys.stdout
    other.flush()
    stream = sys.stdout if stream_name == "stdout" else sys.stderr
    stream.write(text)
    stream.flush()


def rank_label(rank: int, note: str = "") -> str:
    """The header line above a rank's output: ``[rank 0]``."""
    return f"[rank {rank}]" + (f" {note}" if note else "")


def replay(rank: int, events: list[tuple], note: str = "") -> None:
    """Show one rank's recorded output under its label. Nothing if it printed nothing."""
    if not events:
        return
    _write("stdout", rank_label(rank, note) + "\n")
    for event in events:
        kind = event[0]
        if kind in ("stdout", "stderr"):
            text = event[1]
            _write(kind, text if text.endswith("\n") else text + "\n")
        elif kind == "display":
            _publish(event[1], event[2])


def _publish(data: dict, metadata: dict) -> None:
    if in_kernel():
        from IPython.display import publish_display_data
        sys.stdout.flush()
        sys.stderr.flush()
        publish_display_data(data=data, metadata=metadata)
    else:
        _write("stdout", data.get("text/plain", "<rich output>") + "\n")


def say(message: str) -> None:
    """A line from ddplab itself, on stdout so nbval compares it."""
    _write("stdout", message.rstrip("\n") + "\n")
