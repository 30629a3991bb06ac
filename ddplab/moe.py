"""A mixture of experts on one process, the reference notebook 14's expert parallelism is compared with.

    x = moe.tokens(6, dim=8, seed=rank)            # this rank's tokens, (tokens, dim), float64
    router = moe.Router(dim=8, num_experts=4)      # the same on every rank
    idx, gates, probs = router(x, k=2)             # each token's k experts and their weights
    experts = moe.experts(4, dim=8)                # every expert; rank r keeps moe.local(...) of them
    y = moe.reference(x, idx, gates, experts)      # what the distributed layer must return

A token goes to its ``k`` best experts (top-k of the router's softmax); its output
is the sum of those experts' outputs weighted by ``gates`` (the top-k
probabilities, renormalised to sum to 1). With expert parallelism, expert ``e``
lives on rank ``e // (num_experts // world_size)`` (``owner``), so tokens travel
to their experts and back.

Capacity: an expert takes at most ``capacity`` token assignments from a batch
(``capacity(...)``: the factor times an even share); ``capacity_keep`` says
which assignments fit, in token order, and the rest are *dropped*: marked -1 in
``idx`` by ``drop``, they go nowhere and add nothing to the token's output.

``Expert(work=s)`` sleeps ``s`` seconds per token inside a region ``expert e``,
so that on a CPU lab an expert given many tokens shows on the timeline as the
straggler, as a big expert would on a GPU.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from .rank.trace import region

__all__ = ["Expert", "Router", "capacity", "capacity_keep", "drop", "experts", "local", "owner",
           "reference", "tokens"]


def tokens(n: int, dim: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``n`` tokens of ``dim`` features, the same for a seed."""
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(1000 + seed), dtype=dtype)


class Router(nn.Module):
    """A linear router: per token, softmax over the experts, its top ``k``.

    ``skew`` adds to the logits of the last expert: a router that sends it most
    tokens, as an unbalanced router does.
    """

    def __init__(self, dim: int, num_experts: int, seed: int = 0, skew: float = 0.0,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(dim, num_experts, generator=g, dtype=dtype))
        bias = torch.zeros(num_experts, dtype=dtype)
        bias[-1] = skew
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor, k: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(idx, gates, probs)``: the k experts (tokens, k), their weights, every expert's probability."""
        probs = torch.softmax(x @ self.weight + self.bias, dim=-1)
        top, idx = probs.topk(k, dim=-1)
        return idx, top / top.sum(-1, keepdim=True), probs


class Expert(nn.Module):
    """A small MLP (dim -> hidden -> dim, tanh); with ``work``, it also sleeps that long per token."""

    def __init__(self, index: int, dim: int, hidden: int = 16, work: float = 0.0,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.index, self.work = index, work
        with torch.random.fork_rng():            # seeded by its index, leaving the caller's generator be
            torch.manual_seed(100 + index)
            self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with region(f"expert {self.index}"):
            if self.work:
                time.sleep(self.work * len(x))
            return self.net(x)


def experts(num: int, dim: int, hidden: int = 16, work: float = 0.0) -> list[Expert]:
    """Every expert, the same on every rank: a rank keeps those ``local`` names."""
    return [Expert(e, dim, hidden, work) for e in range(num)]


def owner(expert: int, num_experts: int, world_size: int) -> int:
    """The rank that holds ``expert``: experts are dealt out in blocks of num_experts // world_size."""
    return expert // (num_experts // world_size)


def local(rank: int, num_experts: int, world_size: int) -> list[int]:
    """The experts rank ``rank`` holds."""
    per = num_experts // world_size
    return list(range(rank * per, (rank + 1) * per))


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """How many assignments an expert takes from a batch: ``factor`` times an even share, rounded up."""
    return math.ceil(factor * tokens * k / num_experts)


def capacity_keep(idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments fit (bool, like idx): each expert keeps its first ``capacity``, in token order."""
    flat = idx.reshape(-1)
    one_hot = torch.nn.functional.one_hot(flat, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1)        # 1 for an expert's first assignment, ...
    return (position <= capacity).reshape(idx.shape)


def drop(idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``idx`` with the dropped assignments marked -1: they go to no expert."""
    return torch.where(keep, idx, torch.full_like(idx, -1))


def reference(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, all_experts: list) -> torch.Tensor:
    """One process: each token's output, the gate-weighted sum of its experts' outputs (-1: none)."""
    out = torch.zeros_like(x)
    with torch.no_grad():
        for t in range(len(x)):
            for e, gate in zip(idx[t].tolist(), gates[t]):
                if e >= 0:
                    out[t] += gate * all_experts[e].net(x[t:t + 1])[0]
    return out
