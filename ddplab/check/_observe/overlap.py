"""Communication against backward: which ops started inside it, and which still ran while it computed.

"All_reduce overlapped with backward" is two facts, and both must be observed:
the op was *issued* while backward ran (between the checker's marks
``"backward starts"`` and ``"backward ends"``, set by ``backward``), and it was
still *pending* when backward went on to the next gradient (the next mark after
it in the record, set by the checker's own hook, ``schedule.Watch.gradients``,
that runs right after the student's hook). A hook that waits for its own
"async" all_reduce issues inside backward and is complete by the next mark:
nothing overlapped. A hook on one parameter with the rest all_reduced after
backward issues one op inside and the others after ``"backward ends"``.

On one machine a tiny all_reduce completes in microseconds, often before the
next mark, overlapped or not; a sleep on the other ranks does not fix it (under
load a rank that started backward later finds the others' ops already issued).
``pace`` makes it exact on rank 0: after rank 0 set its mark for its n-th
gradient, it says so in the group's store (not a collective: nothing is
recorded), and every other rank waits for that word before its own n-th
gradient is accumulated, so before its hook issues the matching op. Rank 0's op
for that gradient cannot complete before rank 0's mark, since the other ranks
have not issued theirs yet: an op not waited for is pending at the mark, every
time, whatever the machine's load. A hook that waits for its own op would wait
forever for ranks that wait for its mark: they give up after ``timeout``
seconds, issue, and rank 0's op completes before its mark. So the question is
decided on rank 0, in both directions; the other ranks' view is the paced one.

How a checker uses this (on a rank)::

    with wire.recording() as record:
        handles = student_install(model)          # the student's hooks first...
        late = overlap.straggle(list(model.parameters()), 0.02)
        with overlap.backward(record, step=0):
            loss(model, x, y).backward()
        student_finish(handles)
        record.mark("step", step=0)
    facts = overlap.facts(record, step=0)          # plain data; judge rank 0's
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from .record import Mark, Record

log = logging.getLogger(__name__)

__all__ = ["backward", "facts", "pace"]


def pace(params: list[Any], key: str, timeout: float = 0.5, prompt: int = 0) -> list[Any]:
    """Hold every rank's n-th gradient of ``params`` until rank ``prompt`` has passed its own.

    On ``prompt``: a post-accumulate hook per parameter that writes ``key/n`` to the
    default group's store (register it after ``Watch.gradients``, so the mark comes
    first). On the other ranks: a tensor hook per parameter (autograd runs those before
    accumulating, before any student hook) that waits for ``key/n``, at most ``timeout``
    seconds. ``key`` must be new for each call and the same on every rank (the checker
    draws it). Returns the hooks' handles.
    """
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    count = [0]

    def word() -> str:
        count[0] += 1
        return f"{key}/{count[0]}"

    if dist.get_rank() == prompt:
        def passed(param: Any) -> None:
            store.set(word(), "1")
        return [param.register_post_accumulate_grad_hook(passed) for param in params]

    wait = datetime.timedelta(seconds=timeout)

    def held(grad: Any) -> None:
        try:
            store.wait([word()], wait)
        except RuntimeError:      # timed out (DistStoreError, or a FileStore's plain RuntimeError):
            # rank 0 is stuck in a wait of its own, for this rank: go on
            log.debug("rank %d waited %s s for %s: going on", prompt, timeout, key)

    return [param.register_hook(held) for param in params]


@contextlib.contextmanager
def backward(record: Record, step: int = 0) -> Iterator[None]:
    """Mark ``"backward starts"`` and ``"backward ends"`` (with ``step``) around the block."""
    record.mark("backward starts", step=step)
    try:
        yield
    finally:
        record.mark("backward ends", step=step)


def _mark(record: Record, name: str, step: int) -> Mark | None:
    return next((m for m in record.marks if m.name == name and m.data.get("step") == step), None)


def facts(record: Record, step: int = 0, family: str = "all_reduce") -> dict:
    """What the ops of ``family`` did around backward ``step``, as plain data.

    ``in_backward`` / ``after_backward``: the elements of each op issued inside
    backward / after it (before the mark ``"step"`` of this step, or the end);
    ``overlapped``: ops issued inside backward that were still pending at the
    next mark after them; ``waited_inside``: ops issued inside backward already
    complete by then; ``pending_at_end``: ops of the step pending when backward
    ended; ``pending_at_step``: ops pending at the mark ``"step"`` (a missing
    wait); ``families``: every op's family in the step, in order.
    """
    start, end = _mark(record, "backward starts", step), _mark(record, "backward ends", step)
    if start is None or end is None:
        raise KeyError(f"no backward marks for step {step}: use overlap.backward(record, step={step})")
    stepped = _mark(record, "step", step)
    inside = [op for op in record.between(start, end) if op.family == family]
    after = [op for op in record.between(end, stepped) if op.family == family]
    marks = record.marks
    overlapped = waited = 0
    for op in inside:
        following = next((m for m in marks if m.index > op.index), None)
        still = following is not None and (op.done is None or op.done > following.time)
        overlapped += still
        waited += not still
    in_step = record.between(start, stepped)
    ids = {op.index for op in in_step}
    return {"in_backward": [op.numel for op in inside], "after_backward": [op.numel for op in after],
            "overlapped": overlapped, "waited_inside": waited,
            "pending_at_end": len([op for op in record.pending_at(end) if op.index in ids]),
            "pending_at_step": (len([op for op in record.pending_at(stepped) if op.index in ids])
                                if stepped is not None else None),
            "families": [op.family for op in in_step]}
