"""The picture of a trace too big to draw op by op: each lane in bins a few pixels wide.

A 100k-op trace over a 840-pixel lane puts a hundred ops in every pixel. Drawing
each as a box costs seconds in the kernel and more in the browser, and shows
nothing more than this does: per rank, time is cut into bins ``BIN_PX`` pixels
wide; a bin is coloured by the kind of call that filled most of its time, its
darkness is the share of the bin's time spent inside calls, the hatched lower
half the share spent waiting for another rank, and its tooltip counts every op
that began in it. Stuck calls of a trace read after a hang keep their own box
and open end (``timeline.stuck_mark``). The work is one pass over the events.

``html(trace, keep)`` is what a ``Trace`` shows: ``timeline``'s op-by-op picture up
to ``timeline.MAX_DRAWN`` operations, this one beyond.
"""

from __future__ import annotations

import html as _html
from collections import Counter, defaultdict
from typing import Any

from . import timeline as tl
from .text import plural


def html(trace: Any, keep: Any = None) -> str:
    """The picture of ``trace`` (``keep(event)`` picks what to draw), aggregated when big."""
    events = trace.events if keep is None else [e for e in trace.events if keep(e)]
    compute = trace.compute if keep is None else [c for c in trace.compute if keep(c)]
    if len(events) + len(compute) <= tl.MAX_DRAWN:
        return tl.html(trace, keep)
    return tl.html(trace, keep, binned(trace, events, compute))


def _bins(events: list, low: float, width: float, count: int) -> dict[int, dict]:
    """Per bin index: seconds per colour, seconds waiting, and a count per op."""
    out: dict[int, dict] = defaultdict(lambda: {"busy": defaultdict(float), "waited": 0.0,
                                                 "ops": Counter()})
    for e in events:
        first = min(max(int((e.start - low) / width), 0), count - 1)
        last = min(max(int((e.end - low) / width), first), count - 1)
        fill = tl.colour(e)
        out[first]["ops"][e.op] += 1
        if first == last:               # nearly every op of a big trace: one bin
            out[first]["busy"][fill] += e.end - e.start
            out[first]["waited"] += e.waited
            continue
        for b in range(first, last + 1):
            lo, hi = max(e.start, low + b * width), min(e.end, low + (b + 1) * width)
            out[b]["busy"][fill] += max(hi - lo, 0.0)
        out[first]["waited"] += e.waited
    return out


def binned(trace: Any, events: list, compute: list) -> str:
    """The SVG of ``events`` and ``compute`` (already filtered), aggregated per rank."""
    everything = events + compute
    low = min(e.start for e in everything)
    high = max(e.end for e in everything)
    pad = (high - low) * 0.02 or 1e-4
    low, high = low - pad, high + pad
    plot = tl.WIDTH - tl.LEFT - tl.RIGHT
    count = plot // tl.BIN_PX
    width = (high - low) / count
    def x(t):
        return tl.LEFT + (t - low) / (high - low) * plot
    lane = tl.ROW + 16
    top = 22
    height = top + lane * len(trace.ranks) + 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{tl.WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           tl.DEFS,
           f'<rect width="{tl.WIDTH}" height="{height}" fill="#ffffff"/>',
           f'<text x="{tl.LEFT}" y="12" fill="#555">time since the trace started → '
           f'({len(everything)} operations, {plural(count, "bin")} of {tl.BIN_PX} px per rank)</text>']
    by_rank: dict[int, list] = defaultdict(list)
    for e in everything:
        by_rank[e.rank].append(e)
    for i, rank in enumerate(trace.ranks):
        y = top + i * lane + 6
        shade = "#f7f7f7" if i % 2 else "#ffffff"
        out.append(f'<rect x="0" y="{y - 6}" width="{tl.WIDTH}" height="{lane}" fill="{shade}"/>'
                   f'<text x="6" y="{y + 13}" font-weight="bold">rank {rank}</text>')
        for b, cell in sorted(_bins(by_rank[rank], low, width, count).items()):
            busy = sum(cell["busy"].values())
            fill = max(cell["busy"], key=cell["busy"].get) if busy else tl.COLOURS["compute"]
            share = min(busy / width, 1.0)
            x0 = tl.LEFT + b * tl.BIN_PX
            ops = ", ".join(f"{op} ×{n}" for op, n in cell["ops"].most_common(4))
            tip = _html.escape(f"rank {rank}, {tl.seconds(b * width + low)} to "
                               f"{tl.seconds((b + 1) * width + low)}: {ops or 'inside a longer call'}"
                               f"; {share:.0%} of the time in calls, "
                               f"{min(cell['waited'] / width, 1.0):.0%} waiting for another rank")
            out.append(f'<rect x="{x0}" y="{y}" width="{tl.BIN_PX}" height="{tl.ROW}" fill="{fill}" '
                       f'fill-opacity="{0.25 + 0.75 * share:.2f}"><title>{tip}</title></rect>')
            waited = min(cell["waited"] / width, 1.0)
            if waited > 0.05:
                out.append(f'<rect x="{x0}" y="{y + tl.ROW / 2:.1f}" width="{tl.BIN_PX}" '
                           f'height="{tl.ROW / 2 * waited:.1f}" fill="url(#ddplab-wait)"/>')
        for e in by_rank[rank]:
            if getattr(e, "open", False):
                out.append(tl.box(x(e.start), x(e.end), y, tl.ROW, tl.colour(e), _html.escape(
                    f"rank {rank}: {tl.op_text(e, trace.events)}, stuck in it")))
                out.append(tl.stuck_mark(x(e.end), tl.WIDTH - tl.RIGHT, y, tl.ROW))
    bottom = top + lane * len(trace.ranks)
    for t in tl.ticks(low, high):
        out.append(f'<line x1="{x(t):.1f}" y1="18" x2="{x(t):.1f}" y2="{bottom}" stroke="#e4e4e4"/>'
                   f'<text x="{x(t):.1f}" y="{bottom + 14}" text-anchor="middle" fill="#555">'
                   f'{tl.tick_label(t, high - low)}</text>')
    out.append(tl.legend(bottom + 36))
    out.append(f'<text x="{tl.LEFT}" y="{height - 4}" fill="#555">aggregated: darker = more of the '
               f'bin inside calls; every op is in tr.events and tr.save() (open in Perfetto), '
               f'tr.zoom(start, end) draws a stretch op by op</text>')
    out.append("</svg>")
    return "".join(out)
