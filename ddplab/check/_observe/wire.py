"""What the process group did on this rank while a check ran, seen below ``torch.distributed``'s names.

``with recording() as record:`` records every collective and point-to-point op
this rank's process groups carry out in the block, in order: its family
(``all_reduce``, ``reduce_scatter``, ``send``...), its group (global ranks), its
peer or root (a global rank), the elements this rank hands in, when it was
issued, and the first moment the record saw it complete. ``record.mark(name)``
puts the checker's own landmarks in the same sequence ("backward starts",
"gradient 3 ready", "step"), so a check asks questions such as "which
all_reduces started inside backward" or "which op was still pending at the
step" (``between``, ``pending_at``).

Three layers see the ops, and a check reads them together:

1. **The c10d dispatcher, at the BackendSelect key.** Every ``dist`` function,
   a ``ProcessGroup`` method (``group.allreduce``), DDP's reducer, the
   functional collectives (``torch.distributed._functional_collectives``,
   ``torch.ops._c10d_functional``) and ``torch.ops.c10d.*`` itself reach the
   backend through a ``c10d::`` operator in torch's dispatcher. A Python
   kernel registered for each at ``BackendSelect`` (``torch.library``) records the
   op and redispatches below it. Why BackendSelect, not the Autograd key the
   trace uses (``ddplab.rank.trace``, layer 2): the functional collectives and
   anything under ``torch.inference_mode()`` run below the Autograd keys, and
   the trace's layer never sees them; BackendSelect stays in every op's keyset.
2. **The backend's Python methods.** ``group._get_backend(device).allreduce(...)``
   calls ``ProcessGroupGloo`` directly, past the dispatcher. While recording,
   those methods of ``Backend`` (and any subclass that defines its own) are
   wrappers that record the op and call the real one (as ``_forbid`` swaps them).
3. **torch's flight recorder** (``ddplab.rank.flight``), in the backend's C++
   code: on gloo it records every collective however it was issued, and no
   send or recv. When the block ends, ``confirm`` matches each of its entries
   to an op of layers 1-2 issued on the same thread around the moment the entry
   was made. An entry nobody claims is an op issued below both layers (a
   backend method bound before the check, an extension module): it joins the
   record as an op of layer ``"flight"``, named as the recorder names it. A
   collective of layers 1-2 that the recorder never saw, or saw as another
   family, is listed in ``record.flight["unconfirmed"]``/``["disagree"]``.

``Work.wait`` is wrapped too, to note when each op was waited for (``Op.waited``):
gloo's reduce_scatter Work never reports itself complete, so for it a wait is
the only sign.

What each layer sees on gloo, torch 2.13 (``tests/test_observe_wire.py`` runs
each path on a real lab), beside what ddplab counted with before: ``lab.trace()``
(``ddplab.rank.trace``: ``dist``'s wrappers, and the dispatcher at the Autograd
key) and ``dist.all_reduce`` replaced by a counting wrapper (``AllReduceLog``):

=============================================  ==========  =======  ==============  =========  ========
path                                            dispatcher  backend  flight recorder lab.trace  patched
=============================================  ==========  =======  ==============  =========  ========
``from torch.distributed import all_reduce``    yes         no       yes             yes        no
``group.allreduce`` (a ProcessGroup method)     yes         no       yes             yes        no
``group._get_backend(d).allreduce``             no          yes      yes             no         no
a backend method bound before the check         no          no       yes             no         no
``_functional_collectives.all_reduce``          yes         no       yes             no         no
``torch.ops._c10d_functional``, inference_mode  yes         no       yes             no         no
``torch.ops.c10d.allreduce_``                   yes         no       yes             yes        no
``dist.reduce_scatter_tensor``                  yes         no       as all_reduce   yes        no
``batch_isend_irecv`` (send, recv, peers)       yes         no       no              n/t        no
``backend.send`` / ``backend.recv``             no          yes      no              n/t        no
=============================================  ==========  =======  ==============  =========  ========

(n/t: not tested here.) The flight recorder alone cannot tell a reduce_scatter
from an all_reduce on gloo, and keeps no point-to-point op at all.

Where the record lives, and what "cannot reach" means. The record is the
``Record`` the context manager yields to the checker, and the kernels and
wrappers installed for the block hold it in their closures. No module
attribute holds it, nothing the student's code is handed (its arguments, the
model, the hooks it registers) refers to it, and no name in
``torch.distributed`` or in ddplab is consulted when an op is recorded: so
rebinding names (``dist.all_reduce = ...``, an alias bound early, a
wrapper class) neither hides an op nor adds one. What the student's code
*can* still do, on its own rank, is what any code in a process can: walk the
interpreter (``gc.get_objects()``, a caller's ``f_locals``) to the record and
edit it, or remove the kernels. Layer 3 is the check on that: the flight
recorder's entries live in C++ memory, which Python code can add to (by
issuing ops) but not edit or remove, so a collective deleted from the record
comes back as ``unexplained`` and one renamed or invented shows in
``disagree``/``unconfirmed``; flooding the recorder past its size
(``flight.BUFFER_SIZE``) sets ``record.flight["complete"]`` False, which a
check treats as "cannot tell". Point-to-point ops on gloo have no such
witness: a hostile submission that edits the record by hand can hide a send.

How a checker uses this (on a rank, around the student's code)::

    with wire.recording() as record:
        record.mark("start")
        student(model)
        record.mark("step")
    ops = record.between(record.first("start"), record.first("step"))
    families = [op.family for op in ops]            # what the group did, in order
    return record.plain()                           # plain data for the kernel
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Iterator

from ...rank import flight
from .confirm import confirm
from .record import Mark, Op, Record, global_rank, numel

log = logging.getLogger(__name__)

__all__ = ["DISPATCHED", "P2P", "Mark", "Op", "Record", "recording"]

#: c10d dispatcher op -> (family, index of its process group argument, of its input, of its
#: peer (p2p) or root (collective) argument; None: it has none).
DISPATCHED = {
    "allreduce_": ("all_reduce", 1, 0, None), "allreduce_coalesced_": ("all_reduce", 1, 0, None),
    "broadcast_": ("broadcast", 1, 0, 2), "reduce_": ("reduce", 1, 0, 3),
    "allgather_": ("all_gather", 2, 1, None), "_allgather_base_": ("all_gather", 2, 1, None),
    "allgather_coalesced_": ("all_gather", 2, 1, None),
    "allgather_into_tensor_coalesced_": ("all_gather", 2, 1, None),
    "reduce_scatter_": ("reduce_scatter", 2, 1, None),
    "_reduce_scatter_base_": ("reduce_scatter", 2, 1, None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, 1, None),
    "gather_": ("gather", 2, 1, 3), "scatter_": ("scatter", 2, 1, 3),
    "alltoall_": ("all_to_all", 2, 1, None), "alltoall_base_": ("all_to_all", 2, 1, None),
    "barrier": ("barrier", 1, None, None), "monitored_barrier_": ("barrier", 1, None, None),
    "send": ("send", 1, 0, 2), "recv_": ("recv", 1, 0, 2), "recv_any_source_": ("recv", 1, 0, None),
}
#: ``Backend`` method -> (family, index of its input argument, of its peer argument).
_BACKEND = {
    "allreduce": ("all_reduce", 0, None), "allreduce_coalesced": ("all_reduce", 0, None),
    "broadcast": ("broadcast", 0, None), "reduce": ("reduce", 0, None),
    "allgather": ("all_gather", 1, None), "_allgather_base": ("all_gather", 1, None),
    "allgather_coalesced": ("all_gather", 1, None), "reduce_scatter": ("reduce_scatter", 1, None),
    "_reduce_scatter_base": ("reduce_scatter", 1, None), "gather": ("gather", 1, None),
    "scatter": ("scatter", 1, None), "alltoall": ("all_to_all", 1, None),
    "alltoall_base": ("all_to_all", 1, None), "barrier": ("barrier", None, None),
    "monitored_barrier": ("barrier", None, None), "send": ("send", 0, 1), "recv": ("recv", 0, 1),
    "recv_anysource": ("recv", 0, None),
}
P2P = ("send", "recv")
_busy = [False]      # one record at a time on a rank (a flag: the record itself is not kept here)


# ------------------------------------------------------------------ layer 1: the dispatcher
def _dispatcher_layer(record: Record) -> Any:
    """Register a recording kernel for every c10d op at BackendSelect; returns the library."""
    import torch
    import torch.distributed as dist

    library = torch.library.Library("c10d", "IMPL")
    below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
    for name, (family, pg_at, input_at, other_at) in DISPATCHED.items():
        handle = getattr(torch.ops.c10d, name).default._handle

        def kernel(keyset, *args, _name=name, _family=family, _pg=pg_at, _in=input_at,
                   _other=other_at, _handle=handle, **kwargs):
            start, ns0 = time.perf_counter(), time.time_ns()
            record.poll(start)
            out = _handle.redispatch_boxed(keyset & below, *args, **kwargs)
            ns1, issued = time.time_ns(), time.perf_counter()
            ranks = record.group_ranks(dist.ProcessGroup.unbox(args[_pg]))
            other = global_rank(ranks, args[_other]) if _other is not None else None
            op = Op(0, _family, _name, "dispatcher", ranks,
                    peer=other if _family in P2P else None,
                    root=None if _family in P2P else other,
                    numel=numel(args[_in]) if _in is not None else 0,
                    start=start, issued=issued, ns=(ns0, ns1), thread=threading.get_ident(),
                    on_main=threading.get_ident() == record.main)
            boxed = out[-1] if isinstance(out, tuple) and out else out
            work = torch.distributed.Work.unbox(boxed) if isinstance(boxed, torch.ScriptObject) \
                else None
            record.add(op, work)
            return out

        library.impl(name, kernel, "BackendSelect", with_keyset=True)
    return library


# ------------------------------------------------------------------ layer 2: the backend's methods
def _backend_classes() -> list[type]:
    from torch._C._distributed_c10d import Backend

    found, todo = [Backend], [Backend]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def _group_of_backend(backend: Any, record: Record) -> tuple | None:
    """The global ranks of the process group whose backend ``backend`` is (None: not found)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        for device in ("cpu", "cuda"):
            try:
                if pg._get_backend(torch.device(device)) is backend:
                    return record.group_ranks(pg)
            except Exception:     # no backend for that device
                continue
    return (dist.get_rank(),) if backend.size() == 1 else None


def _backend_layer(record: Record) -> list[tuple[type, str, Any]]:
    """Wrap the backend methods of ``_BACKEND``; returns what to put back."""
    saved = []
    for cls in _backend_classes():
        for method, (family, input_at, peer_at) in _BACKEND.items():
            if method not in cls.__dict__:
                continue
            real = cls.__dict__[method]

            def wrapper(self, *args, _real=real, _method=method, _family=family, _in=input_at,
                        _peer=peer_at, **kwargs):
                start, ns0 = time.perf_counter(), time.time_ns()
                record.poll(start)
                work = _real(self, *args, **kwargs)
                ns1, issued = time.time_ns(), time.perf_counter()
                ranks = _group_of_backend(self, record)
                options = next((a for a in args if hasattr(a, "rootRank")), None)
                op = Op(0, _family, _method, "backend", ranks,
                        peer=global_rank(ranks, args[_peer]) if _peer is not None and
                        len(args) > _peer else None,
                        root=global_rank(ranks, options.rootRank) if options is not None else None,
                        numel=numel(args[_in]) if _in is not None and len(args) > _in else 0,
                        start=start, issued=issued, ns=(ns0, ns1), thread=threading.get_ident(),
                        on_main=threading.get_ident() == record.main)
                record.add(op, work if hasattr(work, "is_completed") else None)
                return work

            saved.append((cls, method, real))
            setattr(cls, method, wrapper)
    return saved


def _wait_layer(record: Record) -> list[tuple[type, str, Any]]:
    """``Work.wait`` notes when each op was waited for (``dist``'s blocking calls wait too)."""
    import torch.distributed as dist

    real = dist.Work.__dict__["wait"]

    def wait(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        finally:
            record.waited(self, time.perf_counter())

    dist.Work.wait = wait
    return [(dist.Work, "wait", real)]


@contextlib.contextmanager
def recording() -> Iterator[Record]:
    """Record every collective and p2p op of this rank in the block (see the module docstring)."""
    if _busy[0]:
        raise RuntimeError("ddplab: a communication record is already running on this rank; a check "
                           "records one block at a time (end the first `with recording()` first).")
    import torch.distributed  # noqa: F401  (the backend classes must exist before they are wrapped)

    _busy[0] = True
    record = Record()
    first, clock = flight.mark(), (time.time_ns(), time.perf_counter())
    library, saved = None, []
    try:
        library = _dispatcher_layer(record)
        saved = _backend_layer(record) + _wait_layer(record)
        yield record
    finally:
        for cls, method, real in reversed(saved):
            setattr(cls, method, real)
        if library is not None:
            library._destroy()
        _busy[0] = False
        record.poll()
        record.forget_works()
        confirm(record, first, clock)
