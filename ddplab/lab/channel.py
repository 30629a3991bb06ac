"""What a rank published through ipyparallel's data channel (``publish_data``) for a call.

The ranks publish three things while a call runs: progress (``ddplab.progress``),
their live screen and status (``ddplab.rank.live``) and debugger requests
(``ddplab.rank.debugger``). The kernel reads all three here, one way.
"""

from __future__ import annotations

from typing import Any


def published(result: Any) -> dict:
    """What a rank published (``publish_data``) so far for ``result``, an AsyncResult.

    Read from the metadata ipyparallel keeps, not through ``result.data``: that
    property re-parses the metadata's timestamps with dateutil on every access,
    which the lab's wait loop did a few times per call (most of ``lab.run``'s
    overhead over a raw ipyparallel call).
    """
    try:
        return result._metadata[0].get("data") or {}
    except (AttributeError, IndexError, TypeError):
        return result.data or {}
