"""What the planner's child changes in torch while it traces: each change says why, and each
falls back to torch's own code where torch's internals are not as expected.

- ``peak_only``: a memory tracker that keeps the rank's peak only (the stock one walks every
  module on every op for per-module peaks the plan never reads), and the most model states
  (parameters, gradients, optimizer state) held at once;
- ``real_meshes``: FSDP over tp joins two device meshes with tensor ops that fail under
  ``FakeTensorMode`` (torch 2.13): joined with fake mode off;
- ``one_chunk_each``: FSDP2 makes world_size chunks of every parameter and keeps one; only the
  chunks it reads are made (the same views), so a plan at 1,024 ranks costs what one at 8 does;
- ``propagation_apart``: DTensor works out an op's output shape by running it on fake tensors of
  the *global* shape, in whatever fake mode is active: under the planner's, torch's tracker
  counted those as the rank's (67 GB of a 70B model's loss under ``loss_parallel``). On a GPU
  they are never allocated; here they run in a fake mode of their own, which the tracker skips.

They run in the throwaway child process of ``ddplab.plan.memory.measure`` only, never in a
notebook's kernel.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["Chunks", "STATES", "one_chunk_each", "peak_only", "propagation_apart", "real_meshes"]

# the tracker categories of parameters, gradients and optimizer state (MemTracker's, FSDPMemTracker's)
STATES = frozenset({"Parameter", "Buffer", "Sharded Param", "Unsharded Param", "All Gather", "Gradient",
                    "Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Optstate", "OptState"})


def peak_only(tracker: type, states: frozenset = frozenset()) -> type:
    """torch's tracker, keeping the rank's peak only, and ``model_states``: the most bytes held
    at once in the categories ``states`` (default: parameters, gradients, optimizer state). On
    every op the stock one also walks every module for its own peak (``_update_peak_stats``):
    most of a plan's time, for numbers the plan never reads. Where torch's internals are not
    as expected, the stock tracker (and ``model_states`` 0)."""
    if not all(hasattr(tracker, name) for name in ("_update_peak_stats", "get_tracker_snapshot")):
        return tracker
    names = states or STATES

    class PeakOnly(tracker):
        model_states = 0

        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)
                held = sum(v for k, v in snapshot.items() if getattr(k, "value", k) in names)
                self.model_states = max(self.model_states, held)

        def reset_peak(self) -> None:
            """Start a new peak (and ``model_states``) from what is held now: the next phase's."""
            self._peak_mem = {device: snap["Total"] for device, snap in self._curr_mem_snap.items()}
            self._peak_mem_snap = {device: dict(snap) for device, snap in self._curr_mem_snap.items()}
            self.model_states = max((sum(v for k, v in snap.items() if getattr(k, "value", k) in names)
                                     for snap in self._curr_mem_snap.values()), default=0)

    return PeakOnly


@contextmanager
def real_meshes() -> Iterator[None]:
    """FSDP over tp joins the two meshes into one (``DeviceMesh._concatenate``, once per
    parameter), which reads the mesh's rank table with tensor ops; under FakeTensorMode those
    fail (``aten.nonzero``). Joined with fake mode off, in this throwaway child only."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    join = DeviceMesh.__dict__["_concatenate"]

    def joined(meshes):
        with unset_fake_temporarily():
            return join.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(joined)
    try:
        yield
    finally:
        DeviceMesh._concatenate = join


class Chunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n``, as FSDP's
    ``_chunk_with_empty`` returns it, each chunk made only when asked for (the same ``narrow``
    view ``torch.chunk`` makes). FSDP keeps this rank's chunk and reads chunk 0's size."""

    def __init__(self, tensor: Any, n: int, dim: int) -> None:
        size = tensor.size(dim)
        self.tensor, self.n, self.dim, self.size = tensor, n, dim, size
        self.step = -(-size // n)                              # torch.chunk's chunk size
        self.made = -(-size // self.step)                      # how many torch.chunk makes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = i + self.n if i < 0 else i
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i >= self.made:
            return self[0].new_empty(0)
        start = i * self.step
        return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))


@contextmanager
def one_chunk_each() -> Iterator[None]:
    """FSDP2 splits every parameter into world_size chunks (``torch.chunk``) and keeps one, twice
    per parameter; under FakeTensorMode each chunk is a fake tensor made in Python, so at 1,024
    ranks most of a plan's time went to chunks rank 0 never keeps. Here only the chunks FSDP
    reads are made, each the view torch.chunk would give it: the same shard, the same bytes
    measured. Where torch's internals are not as expected, torch's own function."""
    import importlib

    module = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param")
    name = "_chunk_with_empty"
    own = getattr(module, name, None)
    if own is None:
        yield
        return

    def chunks(tensor: Any, num_chunks: int, dim: int) -> Any:
        return Chunks(tensor, num_chunks, dim) if tensor.size(dim) > 0 else own(tensor, num_chunks, dim)

    setattr(module, name, chunks)
    try:
        yield
    finally:
        setattr(module, name, own)


@contextmanager
def propagation_apart() -> Iterator[None]:
    """DTensor's shape propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``) runs
    its op on global-shape fake tensors in ``detect_fake_mode() or FakeTensorMode()``: under the
    planner's fake mode that is the tracker's own mode, so the tracker counted them. Here it gets a
    fake mode of its own (as on a GPU, where no fake mode is active), which the tracker skips.
    Where torch's internals are not as expected, torch's own function."""
    import importlib

    module = importlib.import_module("torch.distributed.tensor._sharding_prop")
    own = getattr(module, "detect_fake_mode", None)
    if own is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    apart = FakeTensorMode()
    module.detect_fake_mode = lambda *args, **kwargs: apart
    try:
        yield
    finally:
        module.detect_fake_mode = own
