"""Where is a rank? The torch.distributed call it is in, and the user's line that made it.

Three parts of ddplab ask, each from its own kind of stack, and all answer
through this module, in one wording:

- the live status (``rank.blocked``), from the rank's live frames every 0.2 s:
  ``blocked in recv, cell line 3``;
- the hang report (``lab.diagnose``), from the faulthandler dump the kernel
  reads: ``rank 0: still in all_reduce (cell line 3)``, or for a rank busy in
  its own code ``at cell line 2``;
- the trace (``rank.recorder``), once per recorded call: ``site='cell line 3'``,
  through ``LiveSite``, which reads the same answer off live frames without
  walking the whole stack each time (a 100k-call loop asks 100k times).

A stack here is a sequence of ``(filename, line, function)`` records, innermost
first: what a faulthandler dump lists, and what ``records(frame)`` reads off
live frames. So the wording of a hang is tested on recorded stacks, with no
process at all (``tests/test_where.py``). A cell that calls
``dist.recv_object_list`` waits in this stack::

    .../torch/distributed/distributed_c10d.py  recv               <- where it waits
    .../torch/distributed/c10d_logger.py       wrapper
    .../torch/distributed/distributed_c10d.py  recv_object_list   <- the call
    .../torch/distributed/c10d_logger.py       wrapper
    <rank cell 4>                              <module>, line 3   <- the line
    .../ddplab/rank/engine.py                  run_cell           (never the line)

- **The line** is the innermost frame of a rank cell, ``cell line 3``: the line
  as the notebook shows it (a cell wins over a helper module it called: the
  notebook shows the cell). With no cell on the stack (a function given to
  ``lab.run``) it is the innermost frame of the user's own code, ``fn line 12``,
  named by its function (by its file for code at module level). The user's
  code is whatever is not a library: not site-packages, not the standard
  library, not ddplab, not Python's own ``<frozen ...>`` or ``<string>`` code.
  Code typed in (``<stdin>``, IPython's ``<ipython-input-...>``) is the user's.
- **Inside** is the library function the user's line called, when the rank
  waits in one outside torch.distributed: ``queue.get``, ``subprocess.run``
  (the outermost library frame inward of the line). A rank there, or at its
  own line (``time.sleep`` is C: no frame of its own), is *in its own code*:
  late perhaps, but not waiting for another rank, unless the library is
  autograd's backward, where DDP's reducer waits for the others in C++.
- **The call** is the outermost public function of ``distributed_c10d.py``
  inward of the user's code: ``recv_object_list`` waits in ``recv`` and
  ``all_gather_object`` in ``all_gather``; the user wrote the outer one.
  Stopping at the user's code keeps a launcher's frames further out
  (``torch.distributed.run``) from counting as the call.

The cell filename is spelled here and only here: ``engine`` names each cell's
code with ``CELL_FILENAME``, and everyone who looks for cells uses ``CELL_PREFIX``.
"""

from __future__ import annotations

import inspect
import os
import re
from types import FrameType
from typing import Iterable, Iterator, NamedTuple

#: Filenames of cells compiled on a rank look like this (``engine.run_cell``).
CELL_FILENAME = "<rank cell {n}>"
#: What every rank cell's filename starts with.
CELL_PREFIX = CELL_FILENAME.split("{")[0]
#: What ``Where.in_call()`` says when there was no stack to read.
NO_STACK = "somewhere (no stack could be read)"

#: One frame: ``(filename, line, function)``, as a stack dump names it. ``records``
#: puts the live frame itself in the line's place: ``f_lineno`` costs as much as
#: the rest of the walk, and only the frame the answer names needs it.
Record = tuple[str, "int | FrameType", str]

_C10D_FILE = "/torch/distributed/distributed_c10d.py"
_DISTRIBUTED = "/torch/distributed/"
# The paths of libraries on any machine (a dump may come from another host).
_LIBRARY_MARKS = ("site-packages", "dist-packages", "/lib/python")
#: Where a library's dotted name starts in its path (``module_name``).
_LIBRARY_ROOT = re.compile(r"/(?:site-packages|dist-packages|lib/python\d[\d.]*)(?=/)")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../ddplab
_OWN_MARK = "/ddplab/"
_USER, _CELL, _C10D, _TORCH_DIST, _LIBRARY = range(5)
#: Code typed in, not read from a file: the user's, though its name starts with "<".
_TYPED_IN = ("<stdin>", "<ipython-input-")
#: Libraries a rank may wait for the others inside without a torch.distributed frame: autograd's
#: backward (DDP's reducer all-reduces in C++ from there), and DDP itself.
_WAITS_FOR_OTHERS = ("torch.autograd.", "torch._tensor.backward", "torch.nn.parallel.")
_kinds: dict[str, int] = {}       # filename -> its kind; the trace asks on every call


def _kind(filename: str) -> int:
    kind = _kinds.get(filename)
    if kind is None:
        kind = _classify(filename)
        if not filename.startswith(CELL_PREFIX):      # one per cell: not worth keeping
            _kinds[filename] = kind
    return kind


def _classify(filename: str) -> int:
    if filename.startswith(CELL_PREFIX):
        return _CELL
    if filename.endswith(_C10D_FILE):
        return _C10D
    if _DISTRIBUTED in filename:
        return _TORCH_DIST
    if filename.startswith(_TYPED_IN):
        return _USER                    # <stdin>, or a terminal IPython's (or its test shell's) cell
    if filename.startswith("<") or any(mark in filename for mark in _LIBRARY_MARKS):
        return _LIBRARY
    if filename.startswith(_PACKAGE + os.sep):
        return _LIBRARY
    # ddplab installed at another path (another host's dump, another checkout): the
    # same module of this package. A student's folder that happens to be called
    # "ddplab" holds no such file, so their helper modules stay theirs.
    at = filename.rfind(_OWN_MARK)
    if at >= 0 and os.path.isfile(os.path.dirname(_PACKAGE) + filename[at:]):
        return _LIBRARY
    return _USER


def is_user_code(filename: str) -> bool:
    """Whether a frame in ``filename`` is the user's: a rank cell, or a file no library owns."""
    return _kind(filename) in (_USER, _CELL)


def record(frame: FrameType) -> Record:
    """One live frame as a record (its line read only if the answer names it)."""
    return frame.f_code.co_filename, frame, frame.f_code.co_name


def records(frame: FrameType | None) -> Iterator[Record]:
    """The records of a live stack, innermost first, from ``frame`` outwards."""
    while frame is not None:
        code = frame.f_code
        yield code.co_filename, frame, code.co_name
        frame = frame.f_back


def _number(line: "int | FrameType") -> int:
    return line if type(line) is int else line.f_lineno


class Where(NamedTuple):
    """Where one stack is: the call, the user's line, and how to say it."""

    call: str | None = None        # "all_reduce": the torch.distributed function the user called
    line: str = ""                 # "cell line 3", "fn line 12", "" when no user code is on it
    call_at: int | None = None     # the call's index in the stack (innermost is 0)
    line_at: int | None = None     # the index of the frame ``line`` names
    in_dist: bool = False          # some frame inward of the user's code is torch.distributed
    innermost: str = ""            # the innermost frame's function ("" for an empty stack)
    inside: str = ""               # "queue.get": the library function the user's line called

    def in_call(self) -> str:
        """The hang report's words: ``in all_reduce (cell line 3)``, after "still"."""
        if not self.innermost:
            return NO_STACK
        what = f"in {self.call or (self.inside if self.line else '') or self.innermost}"
        return f"{what} ({self.line})" if self.line else what

    def in_own_code(self) -> bool:
        """Whether the rank runs its own code: at a line of the user's, inside no torch.distributed
        call and no library where it could wait for the other ranks (``_WAITS_FOR_OTHERS``)."""
        return bool(self.line) and not self.in_dist and not self.inside.startswith(_WAITS_FOR_OTHERS)

    def blocked(self) -> str:
        """The live status: ``blocked in send, cell line 3`` (``""`` outside any call)."""
        if self.call is None:
            return ""
        return f"blocked in {self.call}" + (f", {self.line}" if self.line else "")

    def doing(self) -> str:
        """A running rank: ``in send (cell line 1)`` inside torch.distributed, else ``at cell line 3``."""
        if self.in_dist or not self.line:
            return self.in_call()
        return f"at {self.line}"


def locate(stack: Iterable[Record]) -> Where:
    """Find the call and the user's line in ``stack`` (records, innermost first).

    >>> locate([(".../torch/distributed/distributed_c10d.py", 9, "send"),
    ...         ("<rank cell 2>", 3, "<module>")]).in_call()
    'in send (cell line 3)'
    """
    call = call_at = line_at = library = None
    line, innermost, in_dist, in_user = "", "", False, False
    kinds = _kinds                      # the trace asks on every call: keep the loop lean
    for index, (filename, lineno, function) in enumerate(stack):
        if index == 0:
            innermost = function
        kind = kinds.get(filename)
        if kind is None:
            kind = _kind(filename)
        if kind == _CELL:
            line, line_at = f"cell line {_number(lineno)}", index
            break                       # the cell is the line; nothing further out matters
        if kind == _LIBRARY:
            if not in_user:
                library = (filename, function)      # the outermost one so far, inward of the line
            continue
        if kind == _USER:
            if not in_user:
                in_user, line_at = True, index
                name = function if not function.startswith("<") else os.path.basename(filename)
                line = f"{name} line {_number(lineno)}"
            continue                    # a cell further out still wins
        if in_user:
            continue                    # torch code outside the user's: not the call
        in_dist = True
        if kind == _C10D and not function.startswith("_"):
            call, call_at = function, index
    inside = f"{module_name(library[0])}.{library[1]}" if library and line and not in_dist else ""
    return Where(call, line, call_at, line_at, in_dist, innermost, inside)


def module_name(filename: str) -> str:
    """The dotted name of a library's file: ``queue`` for ``/usr/lib/python3.11/queue.py``,
    ``torch.autograd.graph`` for ``.../site-packages/torch/autograd/graph.py``."""
    if filename.startswith("<frozen "):
        return filename[len("<frozen "):].rstrip(">")
    path = filename.replace(os.sep, "/")
    if path.startswith(_PACKAGE + "/"):
        path = "ddplab" + path[len(_PACKAGE):]
    else:
        roots = list(_LIBRARY_ROOT.finditer(path))
        path = path[roots[-1].end():] if roots else path
    parts = [part for part in path.removesuffix(".py").split("/") if part and part != "__init__"]
    return ".".join(parts)


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | \
    inspect.CO_ITERABLE_COROUTINE


class LiveSite:
    """``locate`` for a live stack, cheap enough to ask on every traced call.

    ``site(frame)`` answers ``(line, call)`` as ``locate(records(frame))`` does
    (``line`` None where it is ""). A rank's stack is ~25 frames of ipyparallel and
    ipykernel below the user's code, and ``locate`` walks all of them, looking for a
    cell further out that would win: that walk was most of what tracing cost per
    call. Here it is walked once per calling frame: the frames outward of the user's
    innermost frame ``F`` are the same, at the same lines, for as long as ``F``'s caller
    ``O`` runs (a function's callers stay put until it returns, and the ones further
    out are suspended in calls). So the answer for the part beyond ``O`` is kept, with
    ``O`` itself: the next call from the same loop finds it again by identity.

    ``O`` is held (a frame object holds its locals) until another frame takes its
    place or the trace ends: one frame at most. A generator's frame is never kept: it
    can be resumed from elsewhere, with other callers.
    """

    def __init__(self) -> None:
        # (O, the cell line outward of it or ""): one tuple, so that a thread reading it
        # while another replaces it sees a frame and its own answer.
        self.kept: tuple[FrameType | None, str] = (None, "")

    def site(self, frame: FrameType | None) -> tuple[str | None, str | None]:
        call = None
        kinds = _kinds
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            kind = kinds.get(filename)
            if kind is None:
                kind = _kind(filename)
            if kind == _CELL:
                return f"cell line {frame.f_lineno}", call
            if kind == _USER:
                cell = self._cell_outward(frame.f_back)
                if cell:
                    return cell, call
                name = code.co_name
                if name.startswith("<"):
                    name = os.path.basename(filename)
                return f"{name} line {frame.f_lineno}", call
            if kind == _C10D and not code.co_name.startswith("_"):
                call = code.co_name          # the outermost one inward of the user's code
            frame = frame.f_back
        return None, call

    def _cell_outward(self, outer: FrameType | None) -> str:
        """The line of the innermost cell from ``outer`` outwards, or ""."""
        if outer is None:
            return ""
        kept = self.kept
        if outer is kept[0]:
            return kept[1]
        code = outer.f_code
        if code.co_filename.startswith(CELL_PREFIX):
            return f"cell line {outer.f_lineno}"        # its line moves on: never kept
        found, frame = "", outer.f_back
        while frame is not None:
            if frame.f_code.co_filename.startswith(CELL_PREFIX):
                found = f"cell line {frame.f_lineno}"
                break
            frame = frame.f_back
        if not code.co_flags & _RESUMABLE:
            self.kept = (outer, found)
        return found

    def forget(self) -> None:
        """Let go of the kept frame (the trace ended)."""
        self.kept = (None, "")
