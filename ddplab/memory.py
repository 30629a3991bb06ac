"""Notebook 11's helpers: where a rank's memory goes, activations included.

    from ddplab import memory
    memory.saved_bytes(lambda: model(x).sum())    # bytes autograd saves for backward (the activations)
    memory.breakdown(model, optimizer, x)         # parameters, gradients, optimizer, activations
    memory.deep_mlp(depth=4, width=256)           # a stack of Linear-ReLU blocks to checkpoint
    memory.cuda_peak(lambda: model(x).sum())      # on a GPU: what CUDA's allocator reached meanwhile

``ddplab.sharding.memory`` counts what lives between steps (parameters,
gradients, optimizer state). Activations live only from forward to backward:
they are the tensors autograd keeps to compute the gradients. ``saved_bytes``
counts them as autograd hands them over (``saved_tensors_hooks``), each
storage once, so the number is exact and the same on every machine, unlike
a reading of the process's memory.

On a GPU, ``cuda_peak`` is that reading, from CUDA's own counters: the
allocator's peak above what was allocated before. It holds the activations
and whatever else the call made at once (outputs, temporaries, a fresh
gradient buffer), so it is at least ``saved_bytes`` of the same call.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["breakdown", "cuda_peak", "deep_mlp", "saved_bytes"]


def saved_bytes(forward: Callable[[], Any], model: Any = None) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward()`` runs: the activations.

    Each storage counts once, as its largest saved view (a tensor saved by
    two operations; a batch sliced from a dataset counts the batch only).
    Parameters (``model``'s, and any ``nn.Parameter``) are left
    out: they are counted as parameters, not activations. ``forward`` returns
    what backward would start from; nothing is run backward here.
    """
    import torch

    params = {p.untyped_storage().data_ptr()
              for p in (getattr(model, "module", model).parameters() if model is not None else [])}
    seen: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if not isinstance(tensor, torch.nn.Parameter) and storage.data_ptr() not in params:
            # a view's own bytes, not its storage's: a batch sliced from the dataset is not the dataset
            ptr = storage.data_ptr()
            seen[ptr] = max(seen.get(ptr, 0), tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def breakdown(model: Any, optimizer: Any, x: Any) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients, optimizer state, and activations for ``x``.

    The first three as ``ddplab.sharding.memory`` counts them (call it after a
    step, so that gradients and optimizer state exist); the activations as
    ``saved_bytes`` counts them for one forward of the batch ``x``.
    """
    from .sharding import memory

    out = memory(model, optimizer)
    out["activations"] = saved_bytes(lambda: model(x).sum(), model)
    return out


def cuda_peak(call: Callable[[], Any], device: Any = None) -> int:
    """Bytes CUDA's caching allocator reached while ``call()`` ran, above what it held before.

    ``torch.cuda.max_memory_allocated`` read around the call, after resetting
    the peak (CUDA keeps one peak per device, so your own peak reading is
    reset too: read it before). Only ``device``'s memory is seen (the current
    GPU by default), never the CPU's. Raises ``RuntimeError`` where torch
    sees no GPU.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("ddplab.memory.cuda_peak: torch sees no CUDA GPU here. "
                           "memory.saved_bytes counts activations on any machine.")
    # The allocator counts a tensor when the CPU queues the kernel that makes it,
    # so the counters are complete as soon as call() returns: no synchronize needed.
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    return torch.cuda.max_memory_allocated(device) - before


def deep_mlp(depth: int = 4, width: int = 128, seed: int = 0, dtype: Any = None):
    """64 pixels -> ``depth`` MLP blocks of ``width`` -> 10 classes, as an ``nn.Sequential``.

    ``model[0]`` is the input layer (Flatten, Linear(64, width), ReLU);
    ``model[1]`` .. ``model[depth]`` the blocks, each Linear(width, 4*width),
    ReLU, Linear(4*width, width), ReLU, as in a transformer's MLP; ``model[-1]``
    the classifier. A block saves its wide middle for backward, which is what
    activation recomputation gives back. Built under ``torch.manual_seed(seed)``
    without touching the caller's random state: every rank gets the same weights.
    """
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU())]
        layers += [nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(),
                                 nn.Linear(4 * width, width), nn.ReLU()) for _ in range(depth)]
        layers.append(nn.Linear(width, 10))
        model = nn.Sequential(*layers)
    return model.to(dtype) if dtype is not None else model
