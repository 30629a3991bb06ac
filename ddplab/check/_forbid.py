"""Exercises that build a collective from send/recv may not issue one, under any name.

Replacing ``dist.all_gather`` in the module is not enough: an answer that ran
``from torch.distributed import all_gather as ag`` before the check holds the
real function, and every ``dist`` collective runs through its process group
anyway. So ``forbidding`` refuses the collective itself: for the student's
call only, the methods of torch's process group classes that carry it out
(``ProcessGroup.allgather``, ``.allreduce``, ... and the same methods of
each backend, which a group hands the work to) raise a ``Feedback``
naming the ``dist`` function that was called and the student's line (the
check shows it once, with the ranks that raised it).

Torch's functional collectives (``torch.distributed._functional_collectives``,
``torch.ops._c10d_functional``) reach the backend in C++, past those methods.
So ``forbidding`` also reads torch's flight recorder, which sits in the
process group's C++ code, before and after the student's call
(``ddplab.rank.flight.mark``/``since``): a forbidden collective recorded during
the call fails it, however it was issued. (gloo records a reduce_scatter as an
all_reduce: the recorder's names are what it reports.)

Chapters that build a library's mechanism (DDP's overlap, ZeRO, FSDP, a
pipeline schedule) keep the collectives and refuse the library instead:
``refusing_library`` makes constructing the class that every use of that
library goes through raise, however it was imported. ``fully_shard`` is a
function, but it always builds an ``FSDPState``; ``pipeline()`` builds a
``Pipe``; ``batch_isend_irecv`` takes ``P2POp``s. A library that is plain
functions (torch's DDP compression hooks) is refused by swapping each
function's code object for one that raises: every alias of the function
object (``from ... import bf16_compress_hook as h``, a wrapper that calls it)
runs the swapped code.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from ..rank import flight
from ._feedback import Feedback

__all__ = ["COLLECTIVES", "LIBRARY", "counting", "forbidding", "refusing_library"]

#: torch's collectives, by the ``dist`` function a student knows, and the methods of a
#: process group (or its backend) that carry each one out.
_METHODS = {
    "all_reduce": ("allreduce", "allreduce_coalesced"),
    "reduce": ("reduce",),
    "broadcast": ("broadcast",),
    "all_gather": ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
                   "_allgather_base", "all_gather_single", "all_gather_single_coalesced"),
    "gather": ("gather",),
    "scatter": ("scatter",),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
                       "reduce_scatter_tensor_coalesced", "_reduce_scatter_base"),
    "all_to_all": ("alltoall", "alltoall_base", "all_to_all_single"),
}
#: Every collective that moves data (``barrier`` moves none, and stays allowed).
COLLECTIVES = tuple(_METHODS)

#: torch's parallelism libraries, by the name a student knows, and the classes
#: (module, class) whose ``__init__`` every use of each one runs.
_CLASSES = {
    "DistributedDataParallel": (("torch.nn.parallel.distributed", "DistributedDataParallel"),),
    "ZeroRedundancyOptimizer": (("torch.distributed.optim.zero_redundancy_optimizer",
                                 "ZeroRedundancyOptimizer"),),
    "fully_shard": (("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState"),),
    "FullyShardedDataParallel": (("torch.distributed.fsdp.fully_sharded_data_parallel",
                                  "FullyShardedDataParallel"),),
    "torch.distributed.pipelining": (("torch.distributed.pipelining.stage", "_PipelineStageBase"),
                                     ("torch.distributed.pipelining.schedules", "_PipelineSchedule"),
                                     ("torch.distributed.pipelining._IR", "Pipe")),
    "batch_isend_irecv": (("torch.distributed.distributed_c10d", "P2POp"),),
}
_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
#: Libraries of plain functions: (module, function) whose code is swapped while refused.
_FUNCTIONS = {
    "torch's compression hooks": tuple((_HOOKS, name) for name in (
        "_compress_hook", "fp16_compress_hook", "bf16_compress_hook",
        "fp16_compress_wrapper", "bf16_compress_wrapper")),
    # torch.nn.utils.clip_grad_norm_ and its parts (DTensor-aware: they reduce across shards)
    "clip_grad_norm_": tuple(("torch.nn.utils.clip_grad", name) for name in (
        "clip_grad_norm_", "_get_total_norm", "_clip_grads_with_norm_")),
    # notebook 10 imports them on the ranks (save_state, load_state) for its resumable run
    "ddplab's checkpoint references": tuple(("ddplab.check.nb10_checkpoints_and_failures.sharded", name)
                                            for name in ("reference_save", "reference_load")),
}
#: Every library ``refusing_library`` knows.
LIBRARY = (*_CLASSES, *_FUNCTIONS)
#: What a refused function's swapped code reports: its library's name -> (exercise, builds).
_REFUSING: dict[str, tuple[str, str]] = {}


def _classes() -> list[type]:
    """torch's process group class and every backend class (gloo, nccl, ...) that defines methods."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    found, todo = [dist.ProcessGroup, Backend], [Backend]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def _refusal(collective: str, method: str, exercise: str, builds: str, every: bool):
    def refuse(self, *args, **kwargs):
        __tracebackhide__ = True
        from ddplab.rank.where import locate, records

        found = locate(records(sys._getframe(1)))
        called = (f"dist.{found.call}" if found.call
                  else f"{collective}, through the process group's .{method}")
        at = f" (at {found.line})" if found.line else ""
        how, advice = (("from send/recv", "Use dist.send/dist.recv (or isend/irecv) only.") if every
                       else ("itself", "Build it from the calls the exercise names."))
        raise Feedback(f"{exercise} builds {builds} {how}, so it may not call {called}{at}.",
                       hint=f"the check refuses the collective itself, whatever name it is "
                            f"imported or called by. {advice}")
    return refuse


@contextlib.contextmanager
def forbidding(collectives: tuple[str, ...], exercise: str, builds: str = "all_reduce") -> Iterator[None]:
    """While the block runs, the ``collectives`` (names from ``COLLECTIVES``) raise on this rank.

    ``exercise`` and ``builds`` name the exercise and what it builds, for the message.
    """
    unknown = sorted(set(collectives) - set(_METHODS))
    if unknown:
        raise ValueError(f"ddplab: forbidding() knows the collectives {', '.join(COLLECTIVES)}, "
                         f"not {', '.join(unknown)}.")
    every = set(collectives) == set(COLLECTIVES)
    classes, saved = _classes(), []
    try:
        for collective in collectives:
            for method in _METHODS[collective]:
                for cls in classes:
                    if method in cls.__dict__:      # the raw descriptor: restoring it keeps binding
                        saved.append((cls, method, cls.__dict__[method]))
                        setattr(cls, method, _refusal(collective, method, exercise, builds, every))
        before = flight.mark()
        yield
        _refuse_recorded(flight.since(before), set(collectives), exercise, builds)
    finally:
        for cls, method, value in reversed(saved):
            setattr(cls, method, value)


@contextlib.contextmanager
def counting(op: str) -> Iterator[list[int]]:
    """Count the ``op`` collectives (torch's name: ``all_reduce``) this rank issues in the block.

    ``with counting("all_reduce") as calls: student(model)``, then ``calls[0]``. Read from
    torch's flight recorder, like ``forbidding``'s second look, so every path to the backend
    counts: ``dist.all_reduce`` under any alias, a process group's method, a functional
    collective (patching ``dist.all_reduce`` counted none of those). -1 when the recorder
    cannot tell: more operations than it keeps (``flight.BUFFER_SIZE``) came in the block.
    """
    count = [0]
    before = flight.mark()
    try:
        yield count
    finally:
        seen = flight.since(before)
        count[0] = -1 if seen is None else sum(name == op for _, name in seen)


def _refuse_recorded(recorded: list[tuple[int, str]] | None, forbidden: set[str], exercise: str,
                     builds: str) -> None:
    """Fail if torch's flight recorder saw a forbidden collective during the student's call."""
    __tracebackhide__ = True
    if recorded is None:
        raise Feedback(f"{exercise} issued more operations in one call than torch's flight "
                       f"recorder keeps ({flight.BUFFER_SIZE}), so the check cannot see whether it "
                       f"used a collective.",
                       hint=f"{builds[0].upper() + builds[1:]} needs far fewer: send each chunk once.")
    for seq, op in recorded:
        if op in forbidden:
            raise Feedback(f"{exercise} builds {builds} by hand, so it may not issue {op}: torch's "
                           f"flight recorder saw collective #{seq} ({op}) during the call, issued "
                           f"below torch.distributed's functions (a functional collective, torch.ops).",
                           hint="the check refuses the collective however it reaches the backend. "
                                "Use the calls the exercise names.")


def _refuse_library(name: str, exercise: str, builds: str, frame) -> None:
    __tracebackhide__ = True
    from ddplab.rank.where import locate, records

    found = locate(records(frame))
    at = f" (at {found.line})" if found.line else ""
    raise Feedback(f"{exercise} builds {builds} by hand, so it may not use {name}{at}.",
                   hint="the check refuses the library itself, whatever name it is imported by. "
                        "Write it from the tensors and the dist calls the exercise names.")


def _library_refusal(name: str, exercise: str, builds: str):
    def refuse(self, *args, **kwargs):
        __tracebackhide__ = True
        _refuse_library(f"torch's {name}", exercise, builds, sys._getframe(1))
    return refuse


def _refuse_call(name: str) -> None:
    """What a refused function's swapped code calls (it runs with torch's globals, so it finds us
    through ``sys.modules``)."""
    __tracebackhide__ = True
    exercise, builds = _REFUSING[name]
    _refuse_library(name, exercise, builds, sys._getframe(2))


def _refusing_code(function, name: str):
    """A code object for ``function`` that refuses: no free variables (a code swap needs as many as
    the function has, and torch's hooks have none), the library's name a literal."""
    source = (f"def {function.__name__}(*args, **kwargs):\n"
              f"    __tracebackhide__ = True\n"
              f"    import sys\n"
              f"    sys.modules[{__name__!r}]._refuse_call({name!r})\n")
    space: dict = {}
    exec(compile(source, f"<{name} refused>", "exec"), space)
    return space[function.__name__].__code__


@contextlib.contextmanager
def refusing_library(names: tuple[str, ...], exercise: str, builds: str) -> Iterator[None]:
    """While the block runs, using the libraries ``names`` (from ``LIBRARY``) raises on this rank.

    Collectives stay allowed: building DDP by hand means calling ``dist.all_reduce``.
    ``exercise`` and ``builds`` name the exercise and what it builds, for the message.
    """
    import importlib

    unknown = sorted(set(names) - set(LIBRARY))
    if unknown:
        raise ValueError(f"ddplab: refusing_library() knows {', '.join(LIBRARY)}, "
                         f"not {', '.join(unknown)}.")
    saved, codes = [], []
    try:
        for name in names:
            for module, cls_name in _CLASSES.get(name, ()):
                cls = getattr(importlib.import_module(module), cls_name)
                saved.append((cls, cls.__dict__.get("__init__")))
                cls.__init__ = _library_refusal(name, exercise, builds)
            for module, function_name in _FUNCTIONS.get(name, ()):
                function = getattr(importlib.import_module(module), function_name)
                # a decorated function (clip_grad's _no_grad) calls the one it wraps: swap that
                function = getattr(function, "__wrapped__", function)
                codes.append((function, function.__code__))
                function.__code__ = _refusing_code(function, name)
            _REFUSING[name] = (exercise, builds)
        yield
    finally:
        for function, code in reversed(codes):
            function.__code__ = code
        for cls, init in reversed(saved):
            if init is None:                # it inherited its __init__: inherit it again
                del cls.__init__
            else:
                cls.__init__ = init
        for name in names:
            _REFUSING.pop(name, None)
