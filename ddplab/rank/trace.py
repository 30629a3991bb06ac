"""Record this rank's torch.distributed operations while a trace is on.

The kernel's ``lab.trace()`` calls ``start()`` on every rank, runs the cells,
then calls ``stop()``, which returns the recorded operations as plain data
(one list per field: ``ddplab.rank.recorder``).
Between the two, two layers record:

1. **Python calls.** Each public ``torch.distributed`` function (``send``,
   ``all_reduce``, ``broadcast_object_list``, ``init_process_group``, ...) is
   a thin logging wrapper around the real function, which it holds in a
   closure cell. ``start`` puts a recorder into that cell and ``stop`` puts the
   real function back, so ``dist.send`` stays the same object (``P2POp`` and
   ``batch_isend_irecv`` compare ops by identity) and even a name bound with
   ``from torch.distributed import send`` is recorded. ``Work.wait`` and
   ``torch.autograd.backward`` are swapped the same way, on their class and module.
   The real call runs below the autograd dispatch key, so layer 2 does not
   see it a second time.
2. **Everything else.** Every ``c10d::`` operator (``c10d::allreduce_``, ...)
   goes through torch's dispatcher, whoever calls it: DDP's reducer issues its
   gradient-bucket all_reduces from C++, during the backward pass, where no
   Python wrapper can see them. ``start`` registers a Python kernel for each
   ``c10d::`` op at the Autograd key (``torch.library``); it records the op
   and hands it on to the real kernel (redispatching below the Autograd key).
   ``stop`` deletes the registration. ``isend``, ``irecv``,
   ``batch_isend_irecv`` and ``monitored_barrier`` have no wrapper cell and
   are recorded here too.

Nothing is installed while no trace runs: ``installed()`` lists what is in
place, and is empty then. Ops torch issues from C++ inside
``torch.inference_mode()`` skip the Autograd key and are not seen.

Times are ``time.perf_counter()`` readings, turned into this machine's wall
clock at ``stop`` from one (time.time, perf_counter) pair read at ``start``.
What each call leaves behind is ``ddplab.rank.recorder``'s business.
"""

from __future__ import annotations

import contextlib
import threading
import time

from .recorder import C10D_OPS, CALLS, CallRecorder

_recorder: CallRecorder | None = None


# ------------------------------------------------------------------ installing
_saved: list[tuple] = []      # (undo function, name) for everything start() put in place


def _recording(name: str, raw):
    """``raw`` wrapped so that, while a trace records, each call goes through the recorder."""
    code = raw.__code__
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]

    def recorded(*args, **kwargs):
        recorder = _recorder
        if recorder is None:
            return raw(*args, **kwargs)
        return recorder.call(name, raw, params, args, kwargs)

    return recorded


def _wrap_cell(module, name: str) -> None:
    function = getattr(module, name)
    names = function.__code__.co_freevars
    if "func" not in names:
        return _wrap_attribute(name)
    cell = function.__closure__[names.index("func")]
    raw = cell.cell_contents
    recorded = _recording(name, raw)
    cell.cell_contents = recorded
    _saved.append((lambda: setattr(cell, "cell_contents", raw), f"torch.distributed.{name}"))


def _wrap_attribute(name: str) -> None:
    """For the few functions without a wrapper cell: swap the module attributes."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    raw = getattr(c10d, name)
    recorded = _recording(name, raw)
    recorded.__wrapped__ = raw
    for module in (dist, c10d):
        setattr(module, name, recorded)
    _saved.append((lambda: [setattr(m, name, raw) for m in (dist, c10d)],
                   f"torch.distributed.{name}"))


def _install() -> None:
    global _torch
    import torch
    import torch.distributed as dist
    _torch = torch

    for name in CALLS:
        if hasattr(dist, name):          # a torch without one of them just has fewer to record
            _wrap_cell(dist, name)
    raw_wait = dist.Work.wait

    def wait(self, *args, **kwargs):
        recorder = _recorder
        if recorder is None:
            return raw_wait(self, *args, **kwargs)
        return recorder.wait(raw_wait, self, args, kwargs)

    dist.Work.wait = wait
    _saved.append((lambda: setattr(dist.Work, "wait", raw_wait), "torch.distributed.Work.wait"))
    raw_backward = torch.autograd.backward

    def backward(*args, **kwargs):
        recorder = _recorder
        if recorder is None:
            return raw_backward(*args, **kwargs)
        site, start = recorder.where(2)[0], time.perf_counter()
        recorder.local.backward = site        # DDP's bucket ops, issued inside, share it
        me = threading.get_ident()
        recorder.spans_open[me] = {"op": "backward", "kind": "compute", "start": start,
                                   "site": site}
        try:
            return raw_backward(*args, **kwargs)
        finally:
            recorder.local.backward = None
            recorder.spans_open.pop(me, None)
            recorder.span("backward", start, time.perf_counter(), site)

    torch.autograd.backward = backward
    _saved.append((lambda: setattr(torch.autograd, "backward", raw_backward),
                   "torch.autograd.backward"))
    library = torch.library.Library("c10d", "IMPL")
    # Our kernel sits at the Autograd key; it hands the call on to the keys below it
    # (the backend's kernel). Redispatching with the keyset the dispatcher gives us
    # costs half of calling the op again from Python.
    below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutogradOther)
    for c10d_name in C10D_OPS:
        handle = getattr(torch.ops.c10d, c10d_name).default._handle

        def kernel(keyset, *args, _name=c10d_name, _handle=handle, **kwargs):
            recorder = _recorder
            if recorder is None:
                return _handle.redispatch_boxed(keyset & below, *args, **kwargs)
            return recorder.dispatched(_name, _handle, keyset & below, args, kwargs)

        library.impl(c10d_name, kernel, "Autograd", with_keyset=True)
    _saved.append((library._destroy, "c10d dispatcher kernels (Autograd key)"))


def installed() -> list[str]:
    """What recording has put in place right now; ``[]`` when no trace runs."""
    return [name for _, name in _saved]


def start() -> dict:
    """Begin recording on this rank; returns what the kernel needs to align clocks."""
    global _recorder
    if _saved:                       # a trace that never stopped (an interrupt): drop it
        stop()
    _install()
    _recorder = CallRecorder()
    return {"boot_id": boot_id(), "wall": time.time()}


def stop() -> dict:
    """Stop recording, remove every wrapper and kernel, and return what was recorded."""
    global _recorder
    recorder, _recorder = _recorder, None
    while _saved:
        undo, _ = _saved.pop()
        undo()
    if recorder is None:
        return {"events": [], "compute": [], "recorded": False}
    return dict(recorder.finish(), recorded=True)


def snapshot() -> dict:
    """What the running trace recorded so far, without stopping it; safe from another thread
    while the main thread is stuck in a call (``ddplab.rank.flight`` answers the kernel with
    it after a hang). ``recorded`` is False when no trace runs."""
    recorder = _recorder
    if recorder is None:
        return {"events": [], "compute": [], "recorded": False}
    return dict(recorder.snapshot(), recorded=True)


def boot_id() -> str:
    """Equal on two processes exactly when they share one kernel, and so one clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()


def now() -> float:
    return time.time()


@contextlib.contextmanager
def region(name: str):
    """Mark a stretch of this rank's own work (``"forward"``, ``"step"``) on the timeline.

    Records nothing, and costs nothing, when no trace is running.
    """
    recorder, start = _recorder, time.perf_counter()
    try:
        yield
    finally:
        if recorder is not None:
            recorder.span(name, start, time.perf_counter(), recorder.where(3)[0])
