"""Tracing: a timeline of what the ranks' torch.distributed calls did, who waited for whom.

    with lab.trace() as tr:           # every rank records while the block runs
        lab.run(step)
    tr                                # the picture: one lane per rank
    with ddplab.trace.region("busy"): # on a rank: a stretch of compute on the timeline
        ...

The steps, one module each:

- ``record``: ``Trace``, what ``lab.trace()`` returns: starts and stops the
  ranks' recorders (``ddplab.rank.trace``), puts their clocks on the
  kernel's, keeps the last trace (``last()``, what checkers read);
- ``events``: what the ranks sent, analysed as columns (who matched whom,
  who waited how long), and the ``Event`` made from each row;
- ``picture``: the text summary and the SVG of a trace, one box per op;
- ``bins``: the picture of a big trace, aggregated into 2-pixel bins;
- ``chrome``: the Chrome trace-event JSON that Perfetto opens (``tr.save``);
- ``replay``: the trace re-timed at another world size by the α-β model
  (``tr.replay(world_size=8, alpha=..., beta=...)``), itself a ``Trace``.
"""

from .events import Event
from .record import Clock, Trace, Zoom, last, region, set_last, uneven_work

__all__ = ["Clock", "Event", "Trace", "Zoom", "last", "region", "set_last", "uneven_work"]
