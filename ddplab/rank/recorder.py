"""The recorder behind ``ddplab.rank.trace``: what one rank's traced calls leave behind.

``ddplab.rank.trace`` installs the wrappers and the dispatcher kernels and hands
every call to a ``CallRecorder``; this module turns each call into a plain dict
(op, peer, bytes, group, times, the user's line as ``where`` says it: "cell line 3")
and, at the end, into what the kernel receives: one list per field (``COLUMNS``),
not a dict per call. (A cell's printed output is recorded elsewhere, by
``output.OutputRecorder``.)

What a call costs. A loop of 100k tiny all_reduces is the case to think of: each
traced call does a dict, two clock readings and the user's line. Finding that line
used to walk the whole stack (~25 frames of ipyparallel under the user's code) and
was most of the cost; ``where.LiveSite`` walks it once per calling frame. At the
end, 100k dicts pickled one by one took seconds to ship; as columns, the same rows
are a few lists, whose repeated strings (op names, the same site) pickle once, and
a column of one value (most of them, in a loop of one call) is that value and a
count (``packed``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from .where import LiveSite, locate, records

# Python-level functions: name -> (kind, argument holding the payload, argument naming the peer/root).
CALLS = {
    "send": ("p2p", "tensor", "dst"), "recv": ("p2p", "tensor", "src"),
    "send_object_list": ("p2p", None, "dst"), "recv_object_list": ("p2p", None, "src"),
    "broadcast": ("collective", "tensor", "src"), "all_reduce": ("collective", "tensor", None),
    "all_reduce_coalesced": ("collective", "tensors", None),
    "reduce": ("collective", "tensor", "dst"), "all_gather": ("collective", "tensor", None),
    "all_gather_into_tensor": ("collective", "input_tensor", None),
    "all_gather_single": ("collective", "input_tensor", None),
    "all_gather_coalesced": ("collective", "input_tensor_list", None),
    "gather": ("collective", "tensor", "dst"), "scatter": ("collective", "tensor", "src"),
    "reduce_scatter": ("collective", "input_list", None),
    "reduce_scatter_tensor": ("collective", "input", None),
    "reduce_scatter_single": ("collective", "input", None),
    "all_to_all": ("collective", "input_tensor_list", None),
    "all_to_all_single": ("collective", "input", None), "barrier": ("collective", None, None),
    "all_gather_object": ("collective", None, None), "gather_object": ("collective", None, "dst"),
    "scatter_object_list": ("collective", None, "src"),
    "broadcast_object_list": ("collective", None, "src"),
    "init_process_group": ("setup", None, None), "new_group": ("setup", None, None),
    "destroy_process_group": ("setup", None, None),
}
# c10d dispatcher ops -> the torch.distributed name a student knows them by.
C10D_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced",
    "broadcast_": "broadcast", "allgather_": "all_gather", "_allgather_base_": "all_gather_single",
    "allgather_coalesced_": "all_gather_coalesced",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced", "reduce_": "reduce",
    "gather_": "gather", "scatter_": "scatter", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single", "barrier": "barrier",
    "monitored_barrier_": "monitored_barrier", "send": "isend", "recv_": "irecv",
    "recv_any_source_": "irecv",
}
_ROOT_ARG = {"broadcast_": 2, "reduce_": 3, "gather_": 3, "scatter_": 3}
_PEER_ARG = {"send": 2, "recv_": 2}
# Python functions with no wrapper cell, recorded by the dispatcher layer under their own name.
_UNWRAPPED = ("isend", "irecv", "batch_isend_irecv", "monitored_barrier")
_active: list = [None]               # the CallRecorder of the trace running now, if one is
_torch: Any = None                   # torch, once a CallRecorder exists (ranks import it anyway)
_dist: Any = None                    # and torch.distributed: no import statement per call
#: The fields the kernel receives, one list each, and what a row without the key holds.
COLUMNS = {"op": None, "kind": None, "start": None, "end": None, "done": None, "nbytes": 0,
           "group": None, "peer": None, "root": None, "site": None, "source": "call",
           "blocking": True, "tag": 0, "of": None, "error": None, "open": False}


def _nbytes(value: Any) -> int:
    if isinstance(value, _torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class _Local(threading.local):
    """Per thread: the site of a backward under way (a class default: reading it needs no
    ``getattr(..., None)``)."""
    backward: str | None = None


class CallRecorder:
    """Records one rank's torch.distributed calls while a trace runs (see ``ddplab.rank.trace``)."""

    def __init__(self) -> None:
        global _torch, _dist
        import sys

        import torch
        import torch.distributed
        _torch, _dist = torch, torch.distributed
        self.events, self.compute = [], []
        self.works: dict[int, tuple[Any, dict]] = {}   # id(Work) -> (Work kept alive, its event)
        self.groups: dict[int, tuple] = {}
        self.pending: list[tuple[Any, Any, dict]] = []   # async ops not yet seen complete
        self.futureless: set[str] = set()     # ops whose Work has no future (asking raises)
        self.local = _Local()
        self.live = LiveSite()
        # The calls under way right now, by thread: the inner calls of one add to it, and
        # a snapshot shows it open-ended when the rank is stuck inside (read by another
        # thread: ``snapshot``). A dict by thread id: cheaper to ask than a threading.local.
        self.inflight: dict[int, dict] = {}
        self.spans_open: dict[int, dict] = {}     # a backward under way, by thread
        self.frame = sys._getframe
        self.main = threading.main_thread().ident
        pairs = [(time.perf_counter(), time.time(), time.perf_counter()) for _ in range(5)]
        before, self.wall0, after = min(pairs, key=lambda p: p[2] - p[0])
        self.pc0 = (before + after) / 2
        _active[0] = self

    def group(self, group: Any) -> tuple | None:
        """A group as the tuple of its global ranks; None for the whole world."""
        dist = _dist
        if group is None or group is dist.GroupMember.WORLD:
            return None
        key = id(group)
        if key not in self.groups:     # the group is kept, so its id is not reused meanwhile
            self.groups[key] = (group, tuple(dist.get_process_group_ranks(group)))
        return self.groups[key][1]

    def where(self, depth: int) -> tuple[str | None, str | None]:
        """(the user's line, or None; the torch.distributed function the user called, if unwrapped).

        The second is for the dispatcher layer: an op issued inside ``isend`` (or
        ``batch_isend_irecv``, ``monitored_barrier``) is the rank's own call, not torch's.
        """
        try:
            site, call = self.live.site(self.frame(depth))
        except ValueError:
            # autograd's device thread (backward on a GPU) starts in C++: a stack of
            # fewer than ``depth`` Python frames, none of them the user's
            site, call = None, None
        if site is None and threading.get_ident() != self.main:
            # DDP's backward on a GPU runs on autograd's own thread: the line
            # that started it is on the main thread.
            import sys
            found = locate(records(sys._current_frames().get(self.main)))
            site, call = found.line or None, found.call
        return site, call if call in _UNWRAPPED else None

    # ------------------------------------------------------ layer 1: Python calls
    def call(self, name: str, raw, params: tuple, args: tuple, kwargs: dict) -> Any:
        torch = _torch
        bound = dict(zip(params, args))
        if kwargs:
            bound.update(kwargs)
        kind, payload, peer_arg = CALLS[name]
        me = threading.get_ident()
        parent = self.inflight.get(me)
        if parent is not None:          # inside an object collective: count its bytes there
            parent["nbytes"] += _nbytes(bound.get(payload)) if payload else 0
            with torch._C._AutoDispatchBelowAutograd():
                return raw(*args, **kwargs)
        group = bound.get("group")
        if name == "destroy_process_group":
            self.settle_groups()         # the groups it ends can no longer be looked up after
        now = time.perf_counter()
        if self.pending:
            self.poll(now)
        event = {"op": name, "kind": kind, "start": now, "end": None,
                 "nbytes": _nbytes(bound.get(payload)) if payload else 0,
                 "group": self.group(group) if kind != "setup" else None,
                 "blocking": not bound.get("async_op", False), "tag": bound.get("tag", 0),
                 # frames: 0 this one, 1 the wrapper ``rank.trace`` installed, 2 torch's own
                 "site": self.live.site(self.frame(2))[0] or self.where(3)[0]}
        if peer_arg:
            peer = bound.get(peer_arg)
            group_peer = bound.get("group_" + peer_arg)
            if peer is None and group_peer is not None:
                peer = _dist.get_global_rank(group or _dist.GroupMember.WORLD, group_peer)
            event["peer" if kind == "p2p" else "root"] = peer
        self.inflight[me] = event
        try:
            if payload or name == "barrier":
                with torch._C._AutoDispatchBelowAutograd():
                    result = raw(*args, **kwargs)
            else:                        # setup and object ops: their inner calls report here
                result = raw(*args, **kwargs)
        except BaseException as exc:
            event["error"] = type(exc).__name__
            raise
        finally:
            event["end"] = time.perf_counter()
            self.events.append(event)
            self.inflight.pop(me, None)
        if name in ("recv", "recv_object_list") and event.get("peer") is None:
            event["peer"] = result
        if not event["blocking"] and result is not None:
            self.track(result, event)
        return result

    def track(self, work: Any, event: dict, keep: bool = True) -> None:
        """Remember an async op's Work: for the student's wait() on it, and to see it complete.

        No completion callback: a Python callback makes gloo's worker thread take the
        GIL, and then the next op's enqueue waits for it (we measured issue times of
        5-15 ms instead of 0.1-0.3). Instead every time this rank enters torch.distributed
        again, ``poll`` looks which ops are complete: ``done`` is the first moment ddplab
        saw one complete, an upper bound that is tight while the rank keeps calling.
        """
        if keep:
            self.works[id(work)] = (work, event)
        future = None
        if event["op"] not in self.futureless:
            try:                  # the future completes exactly when torch's own waiters return
                future = work.get_future()
            except RuntimeError:  # gloo's send/recv have none: their Work completes in wait()
                self.futureless.add(event["op"])
        self.pending.append((work, future, event))

    def poll(self, now: float) -> None:
        if self.pending:
            still = []
            for item in self.pending:
                work, future, event = item
                if future.done() if future is not None else work.is_completed():
                    event["done"] = now
                else:
                    still.append(item)
            self.pending = still

    def wait(self, raw, work: Any, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() in self.inflight:
            return raw(work, *args, **kwargs)
        start = time.perf_counter()
        try:
            return raw(work, *args, **kwargs)
        finally:
            end = time.perf_counter()
            self.poll(end)
            of = self.works.get(id(work), (None, None))[1]
            if of is not None and of["op"] == "irecv" and of.get("peer") is None:
                with contextlib.suppress(Exception):
                    of["peer"] = work._source_rank()
            self.events.append({"op": "wait", "kind": "wait", "start": start, "end": end,
                                "of": of, "site": self.where(3)[0]})

    def span(self, name: str, start: float, end: float, site: str | None) -> None:
        self.poll(end)
        self.compute.append({"op": name, "kind": "compute", "start": start, "end": end,
                             "site": site})

    # ------------------------------------------------ layer 2: the c10d dispatcher
    def dispatched(self, name: str, handle, keyset, args: tuple, kwargs: dict) -> Any:
        torch = _torch
        start = time.perf_counter()
        self.poll(start)
        out = handle.redispatch_boxed(keyset, *args, **kwargs)
        end = time.perf_counter()
        pg_index = 1 if isinstance(args[1], torch.ScriptObject) else 2
        payload = _nbytes(args[0] if name == "scatter_" or pg_index == 1 else args[1])
        parent = self.inflight.get(threading.get_ident())
        if parent is not None:           # part of a call layer 1 records (an object collective)
            parent["nbytes"] += payload
            return out
        # Inside backward (DDP's buckets) the site is the backward's: no need to walk the stack.
        site, caller = self.local.backward, None
        if site is None:
            site, caller = self.where(3)
        event = {"op": caller if caller == "monitored_barrier" else C10D_OPS[name],
                 "kind": "p2p" if name in ("send", "recv_", "recv_any_source_") else "collective",
                 "start": start, "end": end, "nbytes": payload, "pg": args[pg_index],
                 "source": "call" if caller else "torch", "blocking": False, "site": site,
                 "tag": 0}
        if name in _PEER_ARG:
            event["group_peer"], event["tag"] = args[_PEER_ARG[name]], args[3]
        elif name == "recv_any_source_":
            event["peer"], event["tag"] = None, args[2]
        if name in _ROOT_ARG:
            event["group_root"] = args[_ROOT_ARG[name]]
        self.events.append(event)
        work = torch.distributed.Work.unbox(out[-1] if isinstance(out, tuple) else out)
        # Keep the Work (so the student's wait() is matched to it) only for ops the
        # student issued; DDP's own Works hold gradient buckets and are waited in C++.
        self.track(work, event, keep=bool(caller))
        return out

    def resolve(self, event: dict) -> None:
        """A dispatcher event's group, peer and root as global ranks (done at stop, off the hot path)."""
        import torch.distributed as dist
        pg = event.pop("pg", None)
        if pg is None:
            return
        try:
            ranks = self.group(dist.ProcessGroup.unbox(pg))
        except (ValueError, RuntimeError, KeyError):
            # Gone from torch's tables without passing through settle_groups:
            # its ranks are unknown, and it is shown as the whole world.
            ranks = None
        event["group"] = ranks
        for local, key in (("group_peer", "peer"), ("group_root", "root")):
            if local in event:
                event[key] = _global(ranks, event.pop(local))

    def settle_groups(self) -> None:
        """Look up now, while they exist, the groups of the ops recorded so far.

        Looking them up at the end (``resolve``) keeps the lookup off the hot
        path, but a group destroyed before then is gone from torch's tables
        (a KeyError): code that makes and ends its own groups (a subgroup's
        ``destroy_process_group``, ``lab.spawn``, ``lab.run_script``) settles first.
        """
        for event in self.events:
            if "pg" in event:
                self.resolve(event)

    # ------------------------------------------------------------ the result
    def finish(self) -> dict:
        """Plain data (see ``_plain``)."""
        if _active[0] is self:
            _active[0] = None
        self.live.forget()
        return self._plain(self.events, self.compute, [])

    def snapshot(self) -> dict:
        """What was recorded so far, read from another thread while the rank may be stuck.

        The main thread may be blocked inside a call (a hang): that call, and a
        ``backward`` under way, come as events with ``open=True`` and ``end`` = now.
        Nothing of the recorder's is changed: the rows read are copies where ``_plain``
        would change them (a list copy and a dict copy are single steps under the GIL,
        so a rank that is still running is read consistently enough: at worst without
        its latest call).
        """
        now = time.perf_counter()
        events, compute = list(self.events), list(self.compute)
        opened = [dict(e, end=now, open=True) for e in list(self.inflight.values())]
        compute += [dict(c, end=now, open=True) for c in list(self.spans_open.values())]
        copies = [dict(e) if "pg" in e else e for e in events]
        return self._plain(copies + opened, compute, events)

    def _plain(self, events: list[dict], compute: list[dict], originals: list[dict]) -> dict:
        """``events`` as the kernel receives them: ``{"events": {field: [value per op]},
        "compute": [dict per span]}``, ops in the order they began, times on this machine's
        wall clock, a wait's ``of`` the index of its op. ``originals``: what copies were
        made of (a wait's ``of`` points at an original)."""
        shift = self.wall0 - self.pc0
        starts = [e["start"] for e in events]
        order = sorted(range(len(events)), key=starts.__getitem__)
        rows = [events[i] for i in order]
        for event in rows:
            if "pg" in event:
                self.resolve(event)
        columns = {key: [e.get(key, default) for e in rows] for key, default in COLUMNS.items()}
        if any(of is not None for of in columns["of"]):
            index = {}
            for position, i in enumerate(order):
                index[id(events[i])] = position
                if i < len(originals):
                    index[id(originals[i])] = position
            columns["of"] = [None if of is None else index.get(id(of)) for of in columns["of"]]
        for key in ("start", "end", "done"):
            columns[key] = [None if t is None else t + shift for t in columns[key]]
        same: dict = {}                  # equal sites as one object: pickled once, then referenced
        columns["site"] = [same.setdefault(site, site) for site in columns["site"]]
        compute = [dict(c, start=c["start"] + shift, end=c["end"] + shift) for c in compute]
        return {"events": {key: packed(values) for key, values in columns.items()},
                "compute": compute}


def packed(values: list) -> list | dict:
    """A column as sent: ``{"all": value, "n": count}`` when every value is the same (in a
    loop of one call, most columns), else the list. Plain data, as JSON carries it too.
    (``count`` compares with ``==``, for which ``True`` is ``1``: the types must agree too.)
    """
    if values and values.count(values[0]) == len(values) and len(set(map(type, values))) == 1:
        return {"all": values[0], "n": len(values)}
    return values

def settle_groups() -> None:
    """Before torch's group tables change under a running trace (``ddplab.rank.owngroup``
    sets the lab's group aside, or ends code's own): see ``CallRecorder.settle_groups``."""
    recorder = _active[0]
    if recorder is not None:
        recorder.settle_groups()


def _global(ranks: tuple | None, local: int | None) -> int | None:
    if local is None or local < 0:
        return None
    return local if ranks is None else ranks[local]
