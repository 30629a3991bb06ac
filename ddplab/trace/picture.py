"""The picture of a trace: one lane per rank, time left to right.

``Trace`` shows itself with these two forms (``ddplab.trace.record``):

- ``html(trace)``: an SVG for JupyterLab, no server needed. Blocking calls are
  boxes on a rank's lane; an async op (``isend``, DDP's bucket all_reduce) is a
  thin bar below, from when it was issued until it was seen complete; hatching marks
  the time a call spent waiting for another rank; an arrow runs from each send
  to its recv; a shaded band across lanes marks each collective while every
  rank was in it. Hover anything for op, bytes, duration and cell line.
- ``summary(trace)``: text, per rank, the ops in order, no times: the same on
  every run, so it is what nbval stores and compares. The HTML is wrapped in
  ``<!-- ddplab-trace -->`` markers that ddplab's nbval sanitize file blanks.
"""

from __future__ import annotations

import html as _html
import math
from collections import defaultdict
from typing import Any

from ..text import plural

WIDTH, LEFT, RIGHT, ROW, FLIGHT = 920, 64, 16, 18, 7
#: More operations than this are drawn aggregated: a screen has ~840 pixels of time per
#: lane, so beyond a few thousand boxes most are under a pixel wide and the browser
#: (and the kernel building the SVG) does work nobody sees.
MAX_DRAWN = 2000
#: Width in pixels of one bin of an aggregated lane.
BIN_PX = 2
COLOURS = {"p2p": "#4e79a7", "collective": "#f28e2b", "torch": "#b07aa1", "wait": "#e15759",
           "setup": "#59a14f", "compute": "#d4cfcb"}
DEFS = ('<defs><pattern id="ddplab-wait" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff" fill-opacity="0.35"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#7a0000" stroke-width="2.5" stroke-opacity="0.55"/>'
        '</pattern><marker id="ddplab-arrow" viewBox="0 0 10 10" refX="9" refY="5" '
        'markerWidth="6" markerHeight="6" orient="auto-start-reverse">'
        '<path d="M 0 0 L 10 5 L 0 10 z" fill="#2f4b7c"/></marker></defs>')
LEGEND = [("p2p", "send / recv"), ("collective", "collective"),
          ("torch", "issued by torch (DDP)"), ("wait", "wait()"), ("setup", "init / destroy"),
          ("compute", "backward / region"), ("hatch", "waiting for another rank")]


# ---------------------------------------------------------------- text form
def size(nbytes: int) -> str:
    """16 B, 8.44 kB, 4.19 MB: three significant digits, the same on every run."""
    if nbytes < 1000:
        return f"{nbytes} B"
    for unit in ("kB", "MB", "GB"):
        nbytes /= 1000
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.3g} {unit}"
    return ""


def seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.0f} µs"


def op_text(event: Any, events: list | None = None, brief: bool = False) -> str:
    """One op in words, without times: ``send to 1 (16 B)``, ``wait (isend to 1)``."""
    if event.kind == "compute":
        return event.op
    if event.kind == "wait":
        if event.of is not None and events is not None:
            return f"wait ({op_text(events[event.of], brief=True)})"
        return "wait"
    words = event.op
    if event.peer is not None:
        words += f" to {event.peer}" if "send" in event.op else f" from {event.peer}"
    elif event.op in ("recv", "irecv"):
        words += " from any"
    if event.root is not None:
        words += f" {'from' if event.op.startswith(('broadcast', 'scatter')) else 'to'} {event.root}"
    if brief:
        return words
    details = [size(event.nbytes)] if event.nbytes else []
    if event.group is not None:
        details.append("group " + ",".join(map(str, event.group)))
    if event.source == "torch":
        details.append("by torch")
    if event.error:
        details.append(f"raised {event.error}")
    if getattr(event, "open", False):
        details.append("stuck in it")
    return words + (f" ({', '.join(details)})" if details else "")


def compress(words: list[str], longest: int = 16) -> list[str]:
    """Repeats as ``×N``: ``a, a, a`` -> ``a ×3``; ``a, b, a, b`` -> ``(a, b) ×2``."""
    out, i = [], 0
    while i < len(words):
        best_period, best_count = 1, 1
        for period in range(1, min(longest, (len(words) - i) // 2) + 1):
            block, count = words[i:i + period], 1
            while words[i + count * period: i + (count + 1) * period] == block:
                count += 1
            if count > 1 and period * count > best_period * best_count:
                best_period, best_count = period, count
        block = words[i:i + best_period]
        if best_count == 1:
            out.append(block[0])
        else:
            text = block[0] if best_period == 1 else f"({', '.join(block)})"
            out.append(f"{text} ×{best_count}")
        i += best_period * best_count
    return out


class _Row:
    """Row ``i`` of a trace's columns, read as its Event would be (what ``op_text`` reads)."""

    def __init__(self, columns: dict[str, list], i: int) -> None:
        self._columns, self._i = columns, i

    def __getattr__(self, name: str) -> Any:
        return self._columns[name][self._i]


class _Rows:
    """A trace's columns, indexed as ``tr.events`` is."""

    def __init__(self, columns: dict[str, list]) -> None:
        self._columns = columns

    def __getitem__(self, i: int) -> _Row:
        return _Row(self._columns, i)


_TEXT = ("kind", "op", "peer", "root", "nbytes", "group", "source", "error", "open")


def _words(columns: dict[str, list]) -> list[str]:
    """``op_text`` of every row of ``columns``, worked out once per distinct op: a loop of
    100k calls has a handful, and the text form then needs no Event made."""
    rows = _Rows(columns)
    of, ops, peers, roots = columns["of"], columns["op"], columns["peer"], columns["root"]
    known: dict[tuple, str] = {}
    out = []
    for i, key in enumerate(zip(*(columns[name] for name in _TEXT))):
        j = of[i]
        if j is not None:                     # a wait's words name the op it waited for
            key += (ops[j], peers[j], roots[j])
        word = known.get(key)
        if word is None:
            word = known[key] = op_text(rows[i], rows)
        out.append(word)
    return out


def summary(trace: Any, width: int = 96, keep: Any = None) -> str:
    """Per rank, the ops in the order the rank began them; repeats as ``×N``."""
    by_rank: dict[int, list] = defaultdict(list)
    if keep is None:                          # the columns: no Event made for a big trace
        columns = trace.columns()
        count = len(columns["op"])
        for rank, start, word in zip(columns["rank"], columns["start"], _words(columns)):
            by_rank[rank].append((start, word))
    else:
        events = _kept(trace.events, keep)
        count = len(events)
        for e in events:
            by_rank[e.rank].append((e.start, op_text(e, trace.events)))
    for c in _kept(trace.compute, keep):
        by_rank[c.rank].append((c.start, op_text(c)))
    lines = [f"trace of {plural(len(trace.ranks), 'rank')} "
             f"{', '.join(map(str, trace.ranks))}: {count} operations"
             + ("" if keep is None else " in the part shown")
             + (" up to a hang" if getattr(trace, "hung", False) else "")
             + ("" if trace.complete else " (incomplete: some ranks could not report)")]
    for rank in trace.ranks:
        items = sorted(by_rank[rank], key=lambda item: item[0])
        # An op's own commas ("2.6 kB, by torch") must not break a line: hide them while wrapping.
        words = [word.replace(", ", "\x01") for _, word in items]
        text = ", ".join(compress(words)) or "(nothing)"
        label = f"rank {rank}: "
        line = label
        pieces = text.split(", ")
        for i, piece in enumerate(pieces):
            piece += "," if i < len(pieces) - 1 else ""
            if len(line) + len(piece) > width and line.strip() not in ("", label.strip()):
                lines.append(line.rstrip())
                line = " " * len(label)
            line += piece + " "
        lines.append(line.rstrip())
    return "\n".join(line.replace("\x01", ", ") for line in lines)


# ---------------------------------------------------------------- the picture
def ticks(low: float, high: float, count: int = 8) -> list[float]:
    span = max(high - low, 1e-9)
    raw = span / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if step * m >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def colour(event: Any) -> str:
    if event.source == "torch":
        return COLOURS["torch"]
    return COLOURS.get(event.kind, "#888")


def _tip(event: Any, trace: Any) -> str:
    parts = [f"rank {event.rank}: {op_text(event, trace.events)}",
             f"{seconds(event.duration)} in the call"]
    if event.waited > 0:
        parts.append(f"{seconds(event.waited)} waiting for another rank")
    if not event.blocking and event.kind not in ("compute", "wait"):
        parts.append(f"complete by {seconds(trace.over(event))} after the trace started")
    if event.site:
        parts.append(event.site)
    if getattr(event, "open", False):
        parts.append("still in it when the trace was read (the hang)")
    return _html.escape(" · ".join(parts))


def _pack(intervals: list[tuple[float, float, Any]]) -> list[tuple[int, Any]]:
    """Greedy rows for overlapping async bars: (row, item)."""
    ends: list[float] = []
    placed = []
    for start, end, item in sorted(intervals, key=lambda x: x[0]):
        row = next((i for i, e in enumerate(ends) if e <= start), len(ends))
        if row == len(ends):
            ends.append(end)
        else:
            ends[row] = end
        placed.append((row, item))
    return placed


def _kept(items: list, keep: Any) -> list:
    return items if keep is None else [e for e in items if keep(e)]


def svg(trace: Any, keep: Any = None) -> str:
    """The picture; ``keep(event)`` picks the events to draw (``tr.zoom``).

    Every operation gets a box: for up to ``MAX_DRAWN`` of them (``ddplab.trace.bins``
    draws bigger traces aggregated, and chooses).
    """
    events = _kept(trace.events, keep)
    compute = _kept(trace.compute, keep)
    everything = events + compute
    if not everything:
        return ('<svg xmlns="http://www.w3.org/2000/svg" width="300" height="30">'
                '<text x="4" y="20" font-size="12">no torch.distributed operations recorded</text></svg>')
    low = min(e.start for e in everything)
    high = max(max(e.end, trace.over(e)) for e in everything)
    pad = (high - low) * 0.02 or 1e-4
    low, high = low - pad, high + pad
    plot = WIDTH - LEFT - RIGHT
    def x(t):
        return LEFT + (t - low) / (high - low) * plot
    drawn = {e.index for e in events}
    # Lanes: a row of calls, then as many thin rows as async ops overlap.
    flights = {r: _pack([(e.start, trace.over(e), e) for e in events if e.rank == r
                         and not e.blocking and e.kind not in ("wait", "compute")])
               for r in trace.ranks}
    top, lane_y, lane_h = 22, {}, {}
    for r in trace.ranks:
        rows = 1 + max((row for row, _ in flights[r]), default=-1)
        lane_y[r], lane_h[r] = top, 8 + ROW + 4 + rows * (FLIGHT + 3) + 6
        top += lane_h[r]
    call_y = {r: lane_y[r] + 8 for r in trace.ranks}
    height = top + 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           DEFS,
           f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>']
    for i, r in enumerate(trace.ranks):
        shade = "#f7f7f7" if i % 2 else "#ffffff"
        out.append(f'<rect x="0" y="{lane_y[r]}" width="{WIDTH}" height="{lane_h[r]}" fill="{shade}"/>'
                   f'<text x="6" y="{call_y[r] + 13}" font-weight="bold">rank {r}</text>')
    for t in ticks(low, high):
        out.append(f'<line x1="{x(t):.1f}" y1="18" x2="{x(t):.1f}" y2="{top}" stroke="#e4e4e4"/>'
                   f'<text x="{x(t):.1f}" y="{top + 14}" text-anchor="middle" fill="#555">'
                   f'{tick_label(t, high - low)}</text>')
    out.append(f'<text x="{LEFT}" y="12" fill="#555">time since the trace started →</text>')
    for instance in trace.collectives():            # every rank inside the collective together
        if not all(e.index in drawn for e in instance):
            continue
        ranks = [e.rank for e in instance if e.rank in lane_y]
        if len(ranks) < 2:
            continue
        a, b = max(e.start for e in instance), min(e.finish for e in instance)
        y0, y1 = min(call_y[r] for r in ranks), max(call_y[r] for r in ranks) + ROW
        out.append(f'<rect x="{x(a):.1f}" y="{y0}" width="{max(x(b) - x(a), 1.5):.1f}" '
                   f'height="{y1 - y0}" fill="{COLOURS["collective"]}" fill-opacity="0.16">'
                   f'<title>{_html.escape(instance[0].op)}: all {len(ranks)} ranks inside</title></rect>')
    for c in compute:
        out.append(box(x(c.start), x(c.end), call_y[c.rank], ROW, COLOURS["compute"], _tip(c, trace))
                   + _label(x(c.start), x(c.end), call_y[c.rank], ROW, c.op))
        if c.open:
            out.append(stuck_mark(x(c.end), WIDTH - RIGHT, call_y[c.rank], ROW))
    for e in events:
        if e.blocking or e.kind == "wait":
            out.append(box(x(e.start), x(e.end), call_y[e.rank], ROW, colour(e), _tip(e, trace)))
            if e.waited > 0:
                out.append(box(x(e.start), x(e.start + e.waited), call_y[e.rank], ROW,
                                "url(#ddplab-wait)", _tip(e, trace)))
            out.append(_label(x(e.start), x(e.end), call_y[e.rank], ROW, e.op))
            if e.open:
                out.append(stuck_mark(x(e.end), WIDTH - RIGHT, call_y[e.rank], ROW))
        else:                                        # the call itself: a tick on the calls row
            out.append(box(x(e.start), x(e.end), call_y[e.rank], ROW, colour(e), _tip(e, trace)))
    for r in trace.ranks:
        for row, e in flights[r]:
            y = call_y[r] + ROW + 4 + row * (FLIGHT + 3)
            out.append(box(x(e.start), x(trace.over(e)), y, FLIGHT, colour(e),
                            _tip(e, trace), opacity=0.7))
    for e in events:                                 # arrows: send -> its recv
        if e.match is None or "send" not in e.op:
            continue
        recv = trace.events[e.match]
        if recv.rank not in call_y or recv.index not in drawn:
            continue
        x0, x1 = x(max(e.start, recv.start)), x(max(recv.end, trace.over(recv)))
        y0 = call_y[e.rank] + (ROW if recv.rank > e.rank else 0)
        y1 = call_y[recv.rank] + (0 if recv.rank > e.rank else ROW)
        out.append(f'<line x1="{x0:.1f}" y1="{y0}" x2="{x1:.1f}" y2="{y1}" stroke="#2f4b7c" '
                   f'stroke-width="1.5" marker-end="url(#ddplab-arrow)"><title>'
                   f'{_html.escape(op_text(e))} → rank {recv.rank}</title></line>')
    out.append(legend(top + 36))
    out.append("</svg>")
    return "".join(out)


def stuck_mark(x0: float, x1: float, y: float, h: float) -> str:
    """An open end: the call had not returned when the trace was read (a hang)."""
    mid = y + h / 2
    return (f'<line x1="{x0:.1f}" y1="{mid:.1f}" x2="{x1:.1f}" y2="{mid:.1f}" stroke="#a00" '
            f'stroke-width="2" stroke-dasharray="4 3" marker-end="url(#ddplab-arrow)">'
            f'<title>still in this call when the hang was reported</title></line>'
            f'<text x="{x0 + 4:.1f}" y="{y - 2:.1f}" fill="#a00">stuck →</text>')


def tick_label(t: float, span: float) -> str:
    if span >= 2:
        return f"{t:.1f} s" if span < 20 else f"{t:.0f} s"
    if span >= 2e-3:
        return f"{t * 1e3:.0f} ms" if span >= 0.02 else f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"


def box(x0: float, x1: float, y: float, h: float, fill: str, tip: str,
         opacity: float = 1.0) -> str:
    return (f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1.0):.1f}" height="{h}" '
            f'fill="{fill}" fill-opacity="{opacity}" stroke="#ffffff" stroke-width="0.5">'
            f'<title>{tip}</title></rect>')


def _label(x0: float, x1: float, y: float, h: float, text: str) -> str:
    """The op's name inside its box, when the box is wide enough to hold it."""
    if x1 - x0 <= 7 * len(text):
        return ""
    return (f'<text x="{(x0 + x1) / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle" '
            f'fill="#111" pointer-events="none" paint-order="stroke" stroke="#ffffff" '
            f'stroke-width="2.5">{_html.escape(text)}</text>')


def legend(y: float) -> str:
    parts, x = [], LEFT
    for key, words in LEGEND:
        fill = "url(#ddplab-wait)" if key == "hatch" else COLOURS[key]
        edge = ' stroke="#999"' if key == "hatch" else ""
        parts.append(f'<rect x="{x}" y="{y - 9}" width="12" height="10" fill="{fill}"{edge}/>'
                     f'<text x="{x + 16}" y="{y}">{words}</text>')
        x += 26 + 6.2 * len(words)
    parts.append(f'<text x="{LEFT}" y="{y + 18}" fill="#555">thin bars: async ops in flight '
                 f'(issued → seen complete); arrows: send → recv; bands: a collective with every rank '
                 f'inside. Hover for details.</text>')
    return "".join(parts)


def html(trace: Any, keep: Any = None, picture: str | None = None) -> str:
    """The SVG (``picture``, else ``svg``'s) in a scrolling box, between markers the nbval
    sanitize file blanks."""
    return ('<!-- ddplab-trace --><div class="ddplab-trace" style="overflow-x:auto">'
            + (svg(trace, keep) if picture is None else picture) + "</div><!-- /ddplab-trace -->")
