"""Pictures of a value across ranks: one row per rank, one column per element.

    ddplab.show("t")                     # the tensor t on every rank, as a rank x element grid
    ddplab.show("before", "after")       # two grids side by side
    ddplab.show(lambda: dist.get_rank()) # or what a function returns on each rank

A collective is easiest to understand as a before/after picture of every
rank's buffer. ``show`` fetches the value from each rank's namespace (the
variables your ``%%ranks`` cells made), brings it to the kernel and returns a
``Picture``. JupyterLab draws its HTML form, a coloured table; its text form
is what nbval compares, so the stored output is the same on every machine.

Only what is drawn travels: each rank cuts its value down to the first 64
elements and works out the figures the picture prints about the rest (how
many in all, the smallest and largest) itself. A 20-million-element tensor
so costs the kernel a few hundred bytes per rank, not gigabytes.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ConfigError

# Light to dark blue. A value's colour depends only on where it sits between the
# smallest and largest number in its picture, so the HTML is deterministic.
_SHADES = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c"]
_MAX_COLUMNS = 64


@dataclass(frozen=True)
class Row:
    """One rank's value, flattened to cells. ``note`` says what it was (dtype, shape).

    ``cells`` holds at most the drawn elements; ``length`` is how many the value
    had in all (``None``: exactly ``cells``), and ``summary`` what the picture says
    about the elements that were cut off, worked out on the rank.
    """
    cells: tuple[Any, ...]
    note: str
    breaks: tuple[int, ...] = ()     # column indexes where a new list item starts
    length: int | None = None
    summary: str = ""

    @property
    def size(self) -> int:
        """How many elements the value had, drawn or not."""
        return len(self.cells) if self.length is None else self.length


@dataclass(frozen=True)
class Grid:
    """One value on every rank: a title and a row per rank."""
    title: str
    rows: dict[int, Row]


def row_of(value: Any, limit: int = _MAX_COLUMNS) -> Row:
    """Flatten a value into at most ``limit`` grid cells. Runs on the rank, so only
    the drawn elements and a few figures about the rest travel to the kernel."""
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1)
        dtype = str(value.dtype).replace("torch.", "")
        return Row(tuple(flat[:limit].cpu().tolist()), f"{dtype}{list(value.shape)}",
                   length=flat.numel(), summary=_summary(flat, limit))
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        cells: list[Any] = []
        breaks, length = [], 0
        for item in value:
            breaks.append(length)
            flat = item.detach().reshape(-1)
            cells.extend(flat[:max(0, limit - len(cells))].cpu().tolist())
            length += flat.numel()
        kind = type(value).__name__
        return Row(tuple(cells), f"{kind} of {len(value)} tensors",
                   tuple(b for b in breaks[1:] if b < limit), length)
    if isinstance(value, (list, tuple)):
        return Row(tuple(value[:limit]), f"{type(value).__name__}[{len(value)}]", length=len(value))
    if value is None:
        return Row((), "None")
    return Row((value,), type(value).__name__)


def _summary(flat: Any, limit: int) -> str:
    """The smallest and largest element of a real tensor too long to draw whole."""
    import torch

    if flat.numel() <= limit or flat.is_complex() or flat.dtype == torch.bool:
        return ""
    low, high = flat.min().item(), flat.max().item()
    return f", min {format_cell(low)}, max {format_cell(high)}"


def fetch(what: str | Callable[[], Any]) -> Row:
    """On a rank: evaluate a name/expression in the rank's namespace, or call a function."""
    from .rank.engine import namespace

    if callable(what):
        return row_of(what())
    try:
        return row_of(eval(what, namespace()))
    except NameError as exc:
        raise NameError(f"{exc}. ddplab.show({what!r}) looks for it in this rank's variables: "
                        f"define it in a %%ranks cell first.") from None


def format_cell(value: Any) -> str:
    """A short, stable spelling of one element: 3, 2.5, 0.3333, True."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


class Picture:
    """Grids of values across ranks; HTML in JupyterLab, text for nbval and terminals."""

    def __init__(self, grids: list[Grid]) -> None:
        self.grids = grids

    def values(self, index: int = 0) -> dict[int, tuple]:
        """The drawn cells of one grid (at most 64 per rank), keyed by rank: for checks and tests."""
        return {rank: row.cells for rank, row in self.grids[index].rows.items()}

    # -------------------------------------------------------------- text form
    def __repr__(self) -> str:
        return "\n\n".join(_grid_text(grid) for grid in self.grids)

    # -------------------------------------------------------------- HTML form
    def _repr_html_(self) -> str:
        panels = "".join(f'<div style="margin-right:2em">{_grid_html(grid)}</div>'
                         for grid in self.grids)
        return f'<div style="display:flex;flex-wrap:wrap;align-items:flex-start">{panels}</div>'


def _columns(grid: Grid) -> int:
    return min(_MAX_COLUMNS, max((row.size for row in grid.rows.values()), default=0))


def _grid_text(grid: Grid) -> str:
    width = _columns(grid)
    labels = {rank: f"rank {rank}" for rank in grid.rows}
    texts = {rank: [format_cell(v) for v in row.cells[:width]] for rank, row in grid.rows.items()}
    col_width = max([len(str(width - 1))] + [len(t) for ts in texts.values() for t in ts] + [1])
    label_width = max(len(label) for label in labels.values())
    lines = [grid.title]
    lines.append(" " * label_width + "  " + " ".join(f"{i:>{col_width}}" for i in range(width)))
    for rank, row in grid.rows.items():
        cells = []
        for i, text in enumerate(texts[rank]):
            sep = "|" if i in row.breaks else " "
            cells.append(sep + f"{text:>{col_width}}" if i else f"{text:>{col_width}}")
        more = f" ... ({row.size} in all{row.summary})" if row.size > width else ""
        body = "".join(cells) if cells else "-"
        lines.append(f"{labels[rank]:<{label_width}}  {body}   {row.note}{more}")
    return "\n".join(lines)


def _shade(value: Any, low: float, high: float) -> tuple[str, str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return "#ffffff", "#000000"
    position = 0.5 if high == low else (value - low) / (high - low)
    index = min(len(_SHADES) - 1, max(0, int(position * (len(_SHADES) - 1) + 0.5)))
    return _SHADES[index], "#ffffff" if index >= 5 else "#000000"


def _grid_html(grid: Grid) -> str:
    width = _columns(grid)
    numbers = [v for row in grid.rows.values() for v in row.cells[:width]
               if isinstance(v, (int, float)) and not isinstance(v, bool)
               and not (isinstance(v, float) and (math.isnan(v) or math.isinf(v)))]
    low, high = (min(numbers), max(numbers)) if numbers else (0, 0)
    cell = "padding:2px 8px;text-align:right;font-family:monospace;border:1px solid #ddd"
    head = "".join(f'<th style="{cell};color:#888">{i}</th>' for i in range(width))
    body = []
    for rank, row in grid.rows.items():
        tds = []
        for i, value in enumerate(row.cells[:width]):
            background, colour = _shade(value, low, high)
            edge = ";border-left:3px solid #333" if i in row.breaks else ""
            tds.append(f'<td style="{cell};background:{background};color:{colour}{edge}">'
                       f"{html.escape(format_cell(value))}</td>")
        tds.extend(f'<td style="{cell}"></td>' for _ in range(width - len(row.cells[:width])))
        body.append(f'<tr><th style="{cell}">rank {rank}</th>{"".join(tds)}'
                    f'<td style="padding-left:8px;color:#888">{html.escape(row.note)}</td></tr>')
    return (f'<table style="border-collapse:collapse"><caption style="text-align:left;'
            f'font-weight:bold">{html.escape(grid.title)}</caption>'
            f'<tr><th></th>{head}<th></th></tr>{"".join(body)}</table>')


def show(*what: str | Callable[[], Any], lab: Any = None, titles: list[str] | None = None,
         ranks: list[int] | None = None) -> Picture:
    """Draw a value from every rank as a rank x element grid, one grid per argument.

    Each argument is the name (or an expression) of a variable on the ranks,
    like ``"t"`` or ``"chunks[0]"``, or a function to call on each rank.
    Tensors are flattened; a list of tensors is drawn with a bar between items.
    ``titles`` names the grids (default: the expressions); ``ranks`` picks rows.
    """
    from .lab.current_lab import current

    if not what:
        raise ConfigError("ddplab.show needs something to draw: the name of a variable on the "
                          "ranks, e.g. ddplab.show('t'), or a function, e.g. ddplab.show(lambda: rank).")
    for item in what:
        if not (isinstance(item, str) or callable(item)):
            raise ConfigError(f"ddplab.show draws a value from every rank, so it takes the name of a "
                              f"variable on the ranks, like ddplab.show('t'), or a function; got "
                              f"{type(item).__name__}. In a %%ranks cell, just print the value.")
    if titles is not None and len(titles) != len(what):
        raise ConfigError(f"ddplab.show got {len(what)} values but {len(titles)} titles; "
                          f"give one title per value.")
    lab = lab if lab is not None else current()
    grids = []
    for index, item in enumerate(what):
        rows = lab.run(fetch, item, ranks=lab.check_ranks(ranks))
        title = titles[index] if titles else (item if isinstance(item, str)
                                              else getattr(item, "__name__", "value"))
        grids.append(Grid(title, dict(sorted(rows.items()))))
    return Picture(grids)
