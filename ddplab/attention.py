"""Attention on one process, the reference notebook 14's ring and Ulysses are compared with.

    q, k, v = attention.qkv(seq=12, heads=4, dim=8)       # (heads, seq, dim), float64
    out = attention.full(q, k, v, causal=True)             # softmax(q k^T / sqrt(d)) v, one process
    mine = attention.shard(q, rank, world_size)            # this rank's slice of the sequence
    out, lse = attention.block(q_mine, k_blk, v_blk, mask) # one block of keys: output and log-sum-exp

A rank that holds only a slice of the keys computes, for its queries, the
softmax over that slice: ``block`` returns that partial output and, per query,
the log-sum-exp of its scores, ``lse = log(sum_j exp(s_j))``. Two partial
results over disjoint key blocks merge into the result over both by weighting
each with ``exp(lse_block - lse_both)``: the online softmax that ring attention
(and FlashAttention inside one GPU) is built on. ``block`` marks its work as a
region ``attend`` on the timeline, so a trace shows compute beside the messages.

Shapes are ``(heads, seq, dim)``; ``mask`` is ``(queries, keys)``, True where a
query may attend a key. A query whose keys are all masked gets output 0 and
log-sum-exp ``-inf``: it saw nothing in that block.
"""

from __future__ import annotations

import math

import torch

from .rank.trace import region

__all__ = ["block", "full", "qkv", "shard"]


def qkv(seq: int, heads: int, dim: int, seed: int = 0,
        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of shape ``(heads, seq, dim)``, the same on every rank for a seed."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(heads, seq, dim, generator=g, dtype=dtype) for _ in range(3))


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``x`` along ``dim`` (the sequence, by default)."""
    return x.chunk(world_size, dim=dim)[rank].contiguous()


def full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Attention over the whole sequence on one process: the answer every split must equal."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        keep = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys: ``(out, lse)``, lse of shape ``(heads, queries)``.

    ``out`` is normalised within the block (its softmax sums to 1 over these keys);
    ``lse`` says how much weight the block carries, for the merge with other blocks.
    """
    with region("attend"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        # exp(score - lse) is the softmax; where a row saw no key (lse = -inf), 0, not nan
        weights = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(q.dtype).min))
        return weights @ v, lse
