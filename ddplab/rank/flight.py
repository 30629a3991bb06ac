"""What collectives this rank issued, from torch's flight recorder, even while it is stuck.

torch records each collective of every process group in a ring buffer (the
"flight recorder"), on gloo as on nccl: in torch 2.13 it is on by default with
2,000 records, and ``TORCH_FR_BUFFER_SIZE``, read when the first group is
made, sets the size (0 turns it off). Each record has the group, the collective's number on
that group (``collective_seq_id``, counted from 1), its op, its sizes, and
whether it finished (``retired``). Two ranks in collective #3 of one group
that recorded different ops or sizes disagree: a mismatch, not a slow rank.

A stuck rank's main thread is inside C++, so no Python code of the kernel's
can run there. ``serve`` starts a thread that sleeps on a named pipe (a FIFO in
the lab's private directory): when the kernel writes to it, the thread reads
the recorder (torch's collectives release the GIL while they wait) and writes
a summary next to it, with the arguments of the send, recv or broadcast the
main thread is in (``current_call``: the recorder does not keep them), and
where in the user's code it is (``current_site``: the line, its source, the
library call it waits in, and how long it has sat in one torch.distributed
call), which tells a rank that is late from one that went past a call. The
same thread answers a ``lab.trace()`` that met a hang with what the trace
recorded up to it (``QUESTIONS``). Costs nothing while nobody asks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

#: Records kept per rank: the last collectives of the groups a cell uses (a hang report reads
#: the latest two of each group). Reading them costs time in proportion (``mark``/``since`` read
#: them around every call a build-it check makes): 2,000 took 35 ms a read, 256 take 4 ms.
BUFFER_SIZE = "256"
#: How many of a group's latest records a summary keeps.
_KEEP_PER_GROUP = 2
_serving: set[str] = set()      # FIFOs a thread of this process already answers
#: What the kernel may ask (one byte each) -> the suffix of the answer file's path:
#: ``?`` the recorder's summary (``summary``), ``T`` what a running ``lab.trace()``
#: recorded so far (``ddplab.rank.trace.snapshot``: a trace that survives a hang).
QUESTIONS = {ord("?"): "", ord("T"): ".trace"}


#: torch's reader of the recorder, taken when the engine starts, before any cell of the
#: notebook's runs: code that replaces it in torch's module later does not blind ``since``.
_read = None


def enable() -> None:
    """Size the recorder (``BUFFER_SIZE``) before any group is made, unless the user set a size."""
    global _read
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER_SIZE)
    try:
        import torch
        _read = torch._C._distributed_c10d._dump_fr_trace_json
    except (ImportError, AttributeError):
        log.debug("no flight recorder in this torch", exc_info=True)


def _entries() -> list[dict]:
    if _read is None:
        return []
    try:
        return json.loads(_read(True, False)).get("entries", [])
    except Exception:                 # never enabled, or no group yet
        log.debug("no flight recorder dump", exc_info=True)
        return []


def mark() -> int:
    """The recorder's latest record number on this rank (-1 before any): pass it to ``since``."""
    return max((int(e.get("record_id", -1)) for e in _entries()), default=-1)


def entries_after(record: int) -> list[dict] | None:
    """The recorder's own entries (dicts as torch dumps them: ``profiling_name``,
    ``time_created_ns``, ``thread_id``, ``process_group``, sizes, ...) made after ``mark()``
    gave ``record``; None when some of them are gone (more than ``BUFFER_SIZE`` came since).
    ``ddplab.check._observe.wire`` checks its record of a check against them."""
    newer = [e for e in _entries() if int(e.get("record_id", -1)) > record]
    if newer and record >= 0 and min(int(e["record_id"]) for e in newer) > record + 1:
        return None
    return newer


def since(record: int) -> list[tuple[int, str]] | None:
    """The collectives (not sends or receives) this rank issued after ``mark()`` gave ``record``:
    (their number on their group, torch's op name, e.g. ``all_reduce``). The recorder sits in
    the process group's C++ code, so it sees every way there: ``dist``, torch's functional
    collectives, ``torch.ops``. None when it cannot tell: more operations than it keeps
    (``BUFFER_SIZE``) came since, and the first of them are gone."""
    entries = _entries()
    newer = [e for e in entries if int(e.get("record_id", -1)) > record]
    if newer and record >= 0 and min(int(e["record_id"]) for e in newer) > record + 1:
        return None
    return [(int(e.get("collective_seq_id", 0)), str(e.get("profiling_name", "?")).split(":")[-1])
            for e in newer if not e.get("is_p2p")]


def summary() -> list[dict]:
    """The latest collectives of each group: group, seq, op, sizes, active (not finished)."""
    import torch
    try:
        dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    except Exception:                 # no recorder (an older torch, or never enabled)
        log.debug("no flight recorder dump", exc_info=True)
        return []
    latest: dict[str, list[dict]] = {}
    members = _members()
    for entry in dump.get("entries", []):
        if entry.get("is_p2p"):
            continue                  # sends and recvs have their own count; collectives here
        group = entry.get("process_group", [str(entry.get("pg_id", "?"))])
        name = "the default group" if group[-1] == "default_pg" else f"group {group[0]}"
        record = {"group": name, "seq": int(entry.get("collective_seq_id", 0)),
                  "op": str(entry.get("profiling_name", "?")).split(":")[-1],
                  "sizes": entry.get("input_sizes", []), "active": not entry.get("retired", True)}
        if group[0] in members:
            record["members"] = members[group[0]]
        latest.setdefault(name, []).append(record)
    return [record for records in latest.values() for record in records[-_KEEP_PER_GROUP:]]


def _members() -> dict[str, list[int]]:
    """The global ranks of each live group, by the name the recorder gives it: a rank of the
    group that issued none of its collectives is behind in it (gloo's recorder has no list)."""
    try:
        import torch.distributed.distributed_c10d as c10d
        return {name: sorted(c10d.get_process_group_ranks(pg))
                for pg, name in list(c10d._world.pg_names.items())}
    except Exception:                 # no group, or a torch that keeps them otherwise
        log.debug("no group members for the flight recorder's summary", exc_info=True)
        return {}


#: The calls whose arguments a hang report may need, and the arguments kept (plain ints only).
_CALLS = ("send", "recv", "isend", "irecv", "broadcast")
_ARGS = ("src", "dst", "tag", "group_src", "group_dst")


def current_call() -> dict | None:
    """The torch.distributed call the main thread is in, with its peer and tag arguments.

    The recorder does not see them: on gloo it records no send or recv, and a
    broadcast without its source. A stuck main thread waits in C++ with the GIL
    released, so this thread reads its Python frames (``sys._current_frames``):
    the innermost ``send``/``recv``/``broadcast`` of ``distributed_c10d`` and its
    locals, e.g. ``{"call": "send", "args": {"dst": 1, "tag": 1}}``. None when
    the main thread is in none of them.
    """
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _CALLS and code.co_filename.endswith("distributed_c10d.py"):
            found = frame.f_locals
            return {"call": code.co_name, "args": {name: found[name] for name in _ARGS
                                                   if type(found.get(name)) is int}}
        frame = frame.f_back
    return None


#: The longest source line a site carries.
_SOURCE_CHARS = 120


def current_site() -> dict:
    """Where the main thread is, in the user's code: ``{"site": {...}}`` with

    - ``at``: the user's line as ``where`` names it (``slow line 5``; "" if none is on the stack);
    - ``source``: that line's text (the rank has every cell's and sent function's lines);
    - ``inside``: the library function that line called (``queue.get``), if any;
    - ``own``: whether the rank runs its own code (``where.Where.in_own_code``): late, maybe,
      but not past any call;
    - ``hidden``: the stack alone does not show where it waits: a cell suspended at an
      ``await`` (the thread is in asyncio's loop), or a ``Work.wait()`` (C++, no frame);
    - ``blocked_s``: seconds it has sat in one torch.distributed call (None: in none), from the
      live status's watch (``live.blocked_for``).
    """
    import linecache

    from . import awaiting, live, where

    frames = list(where.records(sys._current_frames().get(threading.main_thread().ident)))
    found, hidden = where.locate(frames), False
    if found.line_at is None and awaiting.suspended():
        # A cell suspended at an await: the thread is in asyncio's loop; the cell's coroutine
        # and what it awaits are where it is.
        frames = [where.record(frame) for frame in awaiting.suspended()] + frames
        found, hidden = where.locate(frames), True
    source = own = ""
    if found.line_at is not None:
        frame = frames[found.line_at][1]
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if found.in_own_code() and _waits_on_work(source, frame):
            # A handle's wait() (isend, irecv, async_op=True) is C++: no frame of its own.
            found, hidden, own = found._replace(inside="Work.wait"), True, False
        if len(source) > _SOURCE_CHARS:
            source = source[:_SOURCE_CHARS - 3] + "..."
    return {"site": {"at": found.line, "source": source, "inside": found.inside,
                     "own": found.in_own_code() if own == "" else own, "hidden": hidden,
                     "blocked_s": live.blocked_for()}}


def _waits_on_work(source: str, frame: Any) -> bool:
    """Whether ``source``, the line ``frame`` is at, calls ``wait()`` on a torch.distributed
    ``Work`` (the handle ``isend``, ``irecv`` or ``async_op=True`` returned) named there."""
    import re

    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None or ".wait(" not in source:
        return False
    for name in re.findall(r"\b([A-Za-z_]\w*)\.wait\(", source):
        value = frame.f_locals.get(name, frame.f_globals.get(name))
        if isinstance(value, c10d.Work):
            return True
    return False


def _answer(what: int, path: str) -> None:
    if what == ord("T"):
        from . import trace  # imported here: only a trace that met a hang asks
        answer = trace.snapshot()
    else:              # the call the rank is in first, then where it is, then its collectives
        call = current_call()
        answer = ([call] if call else []) + [current_site()] + summary()
    partial = path + ".partial"
    with open(partial, "w") as out:
        json.dump(answer, out)
    os.replace(partial, path)             # the kernel never reads half of it


def serve(request_path: str, answer_path: str) -> None:
    """Answer the kernel's requests on the FIFO ``request_path`` with ``summary()`` as JSON."""
    if request_path in _serving:
        return
    _serving.add(request_path)
    try:
        os.mkfifo(request_path, 0o600)
    except FileExistsError:
        pass
    except OSError:
        log.debug("no FIFO for flight recorder requests", exc_info=True)
        return

    def answer_requests() -> None:
        while True:
            try:
                with open(request_path, "rb") as request:   # sleeps until the kernel writes
                    asked = request.read()
                for what in sorted(set(asked)) or [ord("?")]:
                    if what in QUESTIONS:
                        _answer(what, answer_path + QUESTIONS[what])
            except OSError:
                log.debug("flight recorder requests end", exc_info=True)
                return

    threading.Thread(target=answer_requests, name="ddplab-flight", daemon=True).start()
