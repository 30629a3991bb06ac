"""Notebook 08's helpers: a model big enough to shard, memory per rank, and one training loop.

    from ddplab import sharding
    model = sharding.mlp(seed=0)                   # the same weights on every rank that asks
    sharding.memory(model, optimizer)              # bytes THIS rank holds: parameters, gradients, optimizer
    sharding.train_steps(model, optimizer, 5)      # 5 steps on this rank's share of the digits
    sharding.full_weights(model)                   # every weight as one flat tensor, gathered if sharded
    sharding.tiny_mlp(), sharding.tiny_batch(step, world_size, rank)   # notebook 12's float64 model, data

DDP, ``ZeroRedundancyOptimizer`` and FSDP2 (``fully_shard``) differ in what
each rank keeps, not in what they compute: with the same start, data and
optimizer they take the same steps. ``train_steps`` feeds every way the same
batches (rank r takes samples r, r+N, r+2N, ... of each global batch, as a
``DistributedSampler`` without shuffling does), so their weights can be
compared after N steps. ``memory`` counts the bytes of tensors, the local
shard of a DTensor only, so the sharded ways show what they save.
"""

from __future__ import annotations

from typing import Any

__all__ = ["digits_batch", "full_weights", "memory", "mlp", "tiny_batch", "tiny_mlp", "train_steps"]


def mlp(hidden: int = 128, seed: int = 0, dtype: Any = None):
    """The digits classifier of this notebook: 64 pixels -> hidden -> hidden -> 10 classes.

    Built under ``torch.manual_seed(seed)`` without touching the caller's
    random state, so every rank that calls ``mlp(seed=0)`` holds the same
    weights. 26,122 parameters with ``hidden=128``; every layer's sizes divide
    by 2 and 4, so shards come out even.
    """
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                              nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return model.to(dtype) if dtype is not None else model


def _local(tensor: Any) -> Any:
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _optimizer_state(optimizer: Any) -> Any:
    """The state dict of the optimizer that steps on this rank (ZeRO keeps its own inner one)."""
    inner = getattr(optimizer, "optim", None)        # ZeroRedundancyOptimizer: this rank's share
    return (inner if inner is not None else optimizer).state


def memory(model: Any, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (tensors only).

    Sharded parameters (DTensors) count their local shard only. A DDP model
    also keeps gradient buckets of the same size as the gradients; they are
    left out here, so DDP's real cost is a little higher than shown.
    """
    params = [p for p in model.parameters()]
    out = {"parameters": sum(_local(p).nbytes for p in params),
           "gradients": sum(_local(p.grad).nbytes for p in params if p.grad is not None),
           "optimizer": 0}
    if optimizer is not None:
        for state in _optimizer_state(optimizer).values():
            out["optimizer"] += sum(_local(v).nbytes for v in state.values()
                                    if hasattr(v, "nbytes") and v.dim() > 0)   # not Adam's step count
    return out


def train_steps(model: Any, optimizer: Any, steps: int, batch_size: int = 16,
                dtype: Any = None) -> list[float]:
    """Train ``steps`` steps on this rank's share of the digits; the mean loss of each step.

    Every step's global batch is ``batch_size * world_size`` samples in a fixed
    order; rank r trains on samples r, r+N, r+2N, ... of it. The loss returned
    is averaged over all ranks (an all_reduce), so every rank returns the same
    list. ``dtype`` (e.g. ``torch.float64``) converts the images.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    from .data import digits

    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, _ = digits(dtype=dtype)
    losses = []
    for step in range(steps):
        start = step * batch_size * world
        x, y = train_set[start + rank: start + batch_size * world: world]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def digits_batch(size: int, start: int = 0, dtype: Any = None) -> tuple[Any, Any]:
    """Training samples ``start`` .. ``start + size - 1`` of the digits: ``(images, labels)``.

    Images in ``dtype`` (default float64, for exact comparisons), shape (size, 1, 8, 8).
    """
    import torch

    from .data import digits

    train_set, _ = digits(dtype=dtype or torch.float64)
    return train_set[start:start + size]


def full_weights(model: Any) -> Any:
    """Every parameter of ``model`` (or of the model inside DDP) as one flat tensor, on every rank.

    Sharded parameters are gathered first (``DTensor.full_tensor()``, a
    collective: call it on every rank).
    """
    import torch

    inner = getattr(model, "module", model)
    parts = []
    for p in inner.parameters():
        p = p.detach()
        parts.append((p.full_tensor() if hasattr(p, "full_tensor") else p).flatten())
    return torch.cat(parts)


#: Rows of each step's batch per rank in ``tiny_batch``.
TINY_ROWS = 4


def tiny_mlp(sizes: tuple[int, ...] = (6, 10, 10, 3), seed: int = 0, dtype: Any = None):
    """Notebook 12's model: Linear layers of ``sizes`` with tanh between, float64 unless ``dtype``.

    The same weights on every rank that asks (built under ``torch.manual_seed(seed)``,
    the caller's random state untouched). The default has 213 parameters: an odd
    number, so a flat tensor of them does not split evenly over 2 ranks.
    """
    import torch
    from torch import nn

    layers: list = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers).to(dtype or torch.float64)


def tiny_batch(step: int, world_size: int, rank: int | None = None,
               sizes: tuple[int, ...] = (6, 10, 10, 3)) -> tuple[Any, Any]:
    """Step ``step``'s whole batch for ``tiny_mlp`` (``4 * world_size`` rows), or ``rank``'s 4 rows of it.

    Inputs and targets are float64 and the same on every rank, so one process
    training on the whole batch is the reference for the ranks training on their rows.
    """
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(TINY_ROWS * world_size, sizes[0], generator=g, dtype=torch.float64)
    y = torch.randn(TINY_ROWS * world_size, sizes[-1], generator=g, dtype=torch.float64)
    if rank is None:
        return x, y
    rows = slice(rank * TINY_ROWS, (rank + 1) * TINY_ROWS)
    return x[rows], y[rows]
