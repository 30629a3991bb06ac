"""The picture of a trace too big to draw op by op: each lane in bins a few pixels wide.

A 100k-op trace over a 840-pixel lane puts a hundred ops in every pixel. Drawing
each as a box costs seconds in the kernel and more in the browser, and shows
nothing more than this does: per rank, time is cut into bins ``BIN_PX`` pixels
wide; a bin is coloured by the kind of call that filled most of its time, its
darkness is the share of the bin's time spent inside calls, the hatched lower
half the share spent waiting for another rank, and its tooltip counts every op
that began in it. Stuck calls of a trace read after a hang keep their own box
and open end (``picture.stuck_mark``).

The work is a few numpy passes over the trace's columns (``Trace.columns``): no
``Event`` objects are made for it, so a 200k-op trace draws in a tenth of a second.

``html(trace, keep)`` is what a ``Trace`` shows: ``picture``'s op-by-op picture up
to ``picture.MAX_DRAWN`` operations, this one beyond.
"""

from __future__ import annotations

import html as _html
from types import SimpleNamespace
from typing import Any

from ..text import plural
from . import picture

_FIELDS = ("rank", "op", "kind", "source", "start", "end", "waited", "open")


def html(trace: Any, keep: Any = None) -> str:
    """The picture of ``trace`` (``keep(event)`` picks what to draw), aggregated when big."""
    if keep is None:
        columns, compute = trace.columns(), trace.compute
    else:
        events = [e for e in trace.events if keep(e)]
        columns = {name: [getattr(e, name) for e in events] for name in _FIELDS + ("index",)}
        compute = [c for c in trace.compute if keep(c)]
    if len(columns["op"]) + len(compute) <= picture.MAX_DRAWN:
        return picture.html(trace, keep)
    return picture.html(trace, keep, binned(trace, columns, compute))


def _colours(columns: dict[str, list]) -> tuple[list[str], list[int]]:
    """(the colours used, in the order they first appear: a bin two colours fill
    equally takes the first; each op's colour as an index into them)."""
    pairs: dict[tuple, int] = {}
    fills: list[str] = []
    for kind, source in dict.fromkeys(zip(columns["kind"], columns["source"])):
        fill = picture.colour(SimpleNamespace(kind=kind, source=source))
        if fill not in fills:
            fills.append(fill)
        pairs[(kind, source)] = fills.index(fill)
    return fills, [pairs[pair] for pair in zip(columns["kind"], columns["source"])]


def _bins(rows: dict, low: float, width: float, count: int, n_fills: int, n_ops: int):
    """Per bin: seconds per colour, seconds waiting, a count per op, the first op
    (its row) of each kind to begin in it, and whether anything is in it.

    ``rows`` are one rank's arrays. An op adds its time to the bins it covers (nearly
    every op of a big trace lies inside one bin: those in one ``bincount``), its wait
    and its count to the bin it began in.
    """
    import numpy as np
    start, end = rows["start"], rows["end"]
    first = np.clip(((start - low) / width).astype(np.int64), 0, count - 1)
    last = np.minimum(np.maximum(((end - low) / width).astype(np.int64), first), count - 1)
    fill, op = rows["fill"], rows["op"]
    one = first == last
    busy = np.bincount(first[one] * n_fills + fill[one], weights=(end - start)[one],
                       minlength=count * n_fills).reshape(count, n_fills)
    used = np.bincount(first, minlength=count) > 0
    for i in np.flatnonzero(~one):      # the few that span bins: their share of each
        for b in range(first[i], last[i] + 1):
            lo, hi = max(start[i], low + b * width), min(end[i], low + (b + 1) * width)
            busy[b, fill[i]] += max(hi - lo, 0.0)
        used[first[i]:last[i] + 1] = True
    waited = np.bincount(first, weights=rows["waited"], minlength=count)
    ops = np.bincount(first * n_ops + op, minlength=count * n_ops).reshape(count, n_ops)
    seen = np.full((count, n_ops), len(start))
    np.minimum.at(seen, (first, op), np.arange(len(start)))
    return busy, waited, ops, seen, used


def binned(trace: Any, columns: dict[str, list], compute: list) -> str:
    """The SVG of the ops in ``columns`` and the spans in ``compute`` (both already
    filtered), aggregated per rank."""
    import numpy as np
    n = len(columns["op"])
    merged = {name: list(columns[name]) + [getattr(c, name) for c in compute] for name in _FIELDS}
    fills, fill = _colours(merged)
    names: dict[str, int] = {}
    op = [names.setdefault(name, len(names)) for name in merged["op"]]
    ops = list(names)
    start = np.asarray(merged["start"], dtype=float)
    end = np.asarray(merged["end"], dtype=float)
    rank_of = np.asarray(merged["rank"])
    arrays = {"start": start, "end": end, "fill": np.asarray(fill, dtype=np.int64),
              "op": np.asarray(op, dtype=np.int64), "waited": np.asarray(merged["waited"], dtype=float)}
    low, high = float(start.min()), float(end.max())
    pad = (high - low) * 0.02 or 1e-4
    low, high = low - pad, high + pad
    plot = picture.WIDTH - picture.LEFT - picture.RIGHT
    count = plot // picture.BIN_PX
    width = (high - low) / count
    def x(t):
        return picture.LEFT + (t - low) / (high - low) * plot
    lane = picture.ROW + 16
    top = 22
    height = top + lane * len(trace.ranks) + 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{picture.WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           picture.DEFS,
           f'<rect width="{picture.WIDTH}" height="{height}" fill="#ffffff"/>',
           f'<text x="{picture.LEFT}" y="12" fill="#555">time since the trace started → '
           f'({len(start)} operations, {plural(count, "bin")} of {picture.BIN_PX} px per rank)</text>']
    stuck = [i for i, is_open in enumerate(merged["open"]) if is_open]
    for i, rank in enumerate(trace.ranks):
        y = top + i * lane + 6
        shade = "#f7f7f7" if i % 2 else "#ffffff"
        out.append(f'<rect x="0" y="{y - 6}" width="{picture.WIDTH}" height="{lane}" fill="{shade}"/>'
                   f'<text x="6" y="{y + 13}" font-weight="bold">rank {rank}</text>')
        mine = rank_of == rank
        busy, waited, counts, seen, used = _bins({k: v[mine] for k, v in arrays.items()},
                                           low, width, count, len(fills), len(ops))
        for b in np.flatnonzero(used).tolist():
            total = float(busy[b].sum())
            colour = fills[int(busy[b].argmax())] if total else picture.COLOURS["compute"]
            share = min(total / width, 1.0)
            x0 = picture.LEFT + b * picture.BIN_PX
            # The most frequent first; of equally frequent ones, the first to begin.
            top4 = [j for j in np.lexsort((seen[b], -counts[b]))[:4].tolist() if counts[b, j]]
            words = ", ".join(f"{ops[j]} ×{counts[b, j]}" for j in top4)
            wait = min(float(waited[b]) / width, 1.0)
            tip = _html.escape(f"rank {rank}, {picture.seconds(b * width + low)} to "
                               f"{picture.seconds((b + 1) * width + low)}: {words or 'inside a longer call'}"
                               f"; {share:.0%} of the time in calls, "
                               f"{wait:.0%} waiting for another rank")
            out.append(f'<rect x="{x0}" y="{y}" width="{picture.BIN_PX}" height="{picture.ROW}" '
                       f'fill="{colour}" '
                       f'fill-opacity="{0.25 + 0.75 * share:.2f}"><title>{tip}</title></rect>')
            if wait > 0.05:
                out.append(f'<rect x="{x0}" y="{y + picture.ROW / 2:.1f}" width="{picture.BIN_PX}" '
                           f'height="{picture.ROW / 2 * wait:.1f}" fill="url(#ddplab-wait)"/>')
        for j in stuck:                 # few: each as the Event it is
            if merged["rank"][j] == rank:
                e = trace.events[columns.get("index", range(n))[j]] if j < n else compute[j - n]
                out.append(picture.box(x(e.start), x(e.end), y, picture.ROW, picture.colour(e), _html.escape(
                    f"rank {rank}: {picture.op_text(e, trace.events)}, stuck in it")))
                out.append(picture.stuck_mark(x(e.end), picture.WIDTH - picture.RIGHT, y, picture.ROW))
    bottom = top + lane * len(trace.ranks)
    for t in picture.ticks(low, high):
        out.append(f'<line x1="{x(t):.1f}" y1="18" x2="{x(t):.1f}" y2="{bottom}" stroke="#e4e4e4"/>'
                   f'<text x="{x(t):.1f}" y="{bottom + 14}" text-anchor="middle" fill="#555">'
                   f'{picture.tick_label(t, high - low)}</text>')
    out.append(picture.legend(bottom + 36))
    out.append(f'<text x="{picture.LEFT}" y="{height - 4}" fill="#555">aggregated: darker = more of the '
               f'bin inside calls; every op is in tr.events and tr.save() (open in Perfetto), '
               f'tr.zoom(start, end) draws a stretch op by op</text>')
    out.append("</svg>")
    return "".join(out)
