"""Layer 3 of ``wire``: each collective of the record confirmed by torch's flight recorder.

The flight recorder (``ddplab.rank.flight``) sits in the backend's C++ code: on
gloo it keeps an entry for every collective, however it was issued, and none for
a send or a recv. When a record ends, each entry made during it is matched to
the collective of layers 1-2 issued on the same thread around the moment the
entry was made (``Op.ns``). What comes of it (``record.flight``):

- ``unexplained``: entries no op claims, ops issued below both layers (a
  backend method bound before the check, an extension module, or an op deleted
  from the record): they join the record as ops of layer ``"flight"``, in order.
- ``unconfirmed``: collectives of the record with no entry (invented, or the
  recorder is off: ``checked`` is False then).
- ``disagree``: collectives the recorder saw as another family (renamed).
- ``complete``: False when more ops came than the recorder keeps
  (``flight.BUFFER_SIZE``), and the oldest entries are gone: a check cannot tell.

Python code can add entries (by issuing ops) but not edit or remove them.
"""

from __future__ import annotations

from ...rank import flight
from .record import Op, Record

__all__ = ["FLIGHT_NAMES", "confirm"]

#: The flight recorder's op names (after ``gloo:``) that each family may show as: gloo carries out
#: a reduce_scatter as an all_reduce, and a barrier as its own op.
FLIGHT_NAMES = {
    "all_reduce": {"all_reduce", "allreduce_coalesced"},
    "reduce_scatter": {"reduce_scatter", "all_reduce", "_reduce_scatter_base",
                       "reduce_scatter_tensor_coalesced"},
    "all_gather": {"all_gather", "_allgather_base", "allgather_coalesced",
                   "all_gather_into_tensor_coalesced"},
    "broadcast": {"broadcast"}, "reduce": {"reduce"}, "gather": {"gather"}, "scatter": {"scatter"},
    "all_to_all": {"all_to_all", "alltoall_base"}, "barrier": {"barrier"},
}
#: Clock slack when an entry is matched to an op: none is needed (the entry is made inside the
#: call), a little absorbs the two clocks (time_ns, the recorder's) being read apart.
_SLACK_NS = 50_000
_P2P = ("send", "recv")


def _family_of(flight_name: str) -> str | None:
    families = [f for f, names in FLIGHT_NAMES.items() if flight_name in names]
    return families[0] if len(families) == 1 else None


def confirm(record: Record, first: int, clock: tuple[int, float]) -> None:
    """Match the recorder's entries since ``first`` to the record's collectives (see the docstring)."""
    entries = flight.entries_after(first)
    record.flight["checked"] = flight.mark() >= 0
    if entries is None:
        record.flight["complete"] = False
        return
    if not record.flight["checked"]:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    names = {name: pg for pg, name in c10d._world.pg_names.items()}
    ns0, pc0 = clock
    collectives = [op for op in record.ops if op.family not in _P2P and op.layer != "flight"]
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        name = str(entry.get("profiling_name", "?")).split(":")[-1]
        created, thread = int(entry.get("time_created_ns", 0)), str(entry.get("thread_id", ""))
        owner = next((op for op in collectives if op.ns[0] - _SLACK_NS <= created <= op.ns[1] + _SLACK_NS
                      and (not thread or thread == str(op.thread))), None)
        if owner is not None:
            owner.flight.append(name)
            continue
        group = entry.get("process_group", ["?"])[0]
        pg = names.get(group)
        when = pc0 + (created - ns0) / 1e9
        op = Op(0, _family_of(name) or name, name, "flight",
                tuple(dist.get_process_group_ranks(pg)) if pg is not None else None,
                numel=sum(_prod(size) for size in entry.get("input_sizes", [])),
                start=when, issued=when, done=when, on_main=thread == str(record.main))
        record.flight["unexplained"].append(op)
    for op in collectives:
        if op.via in ("monitored_barrier_", "monitored_barrier"):
            continue                      # gloo's monitored barrier is send/recv: no entry
        if not op.flight:
            record.flight["unconfirmed"].append(op)
        elif any(_family_of(n) not in (None, op.family) and n not in FLIGHT_NAMES.get(op.family, ())
                 for n in op.flight):
            record.flight["disagree"].append(op)
    for op in record.flight["unexplained"]:          # into the sequence, by when it was made
        at = next((i for i, e in enumerate(record.events)
                   if (e.start if isinstance(e, Op) else e.time) > op.start), len(record.events))
        record.events.insert(at, op)
    for i, event in enumerate(record.events):
        event.index = i


def _prod(size: list) -> int:
    n = 1
    for x in size:
        n *= int(x)
    return n
