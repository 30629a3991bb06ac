"""The models of ``ddplab.plan.models.Config`` as torch modules, and their pipeline stages.

    model = build(config)              # nn.Module; model.blocks is an nn.ModuleList
    stage(model, first, last)          # keep blocks [first, last): a pipeline stage

Llama follows torchtitan's ``torchtitan/models/llama/model.py`` (2024-12, the version
of its published Llama 3.1 runs): RMSNorm computed in fp32, ``wq``/``wk``/``wv``/``wo``
without biases, rotary positions as complex numbers, key/value heads repeated to the
query heads before ``scaled_dot_product_attention`` (``repeat_kv``), a SwiGLU MLP
``w2(silu(w1 x) * w3 x)``. GPT has one ``qkv`` matrix, LayerNorm and a ReLU MLP.
Attention reshapes by ``head_dim``, not by a number of heads, so tensor parallelism
can split ``wq``/``qkv``/``w1`` by columns and ``wo``/``proj``/``w2`` by rows
(Megatron's plan) and each rank simply holds fewer heads.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["bounds", "build", "loss", "stage"]


def build(config: Any, dtype: str | None = None) -> Any:
    """``config``'s model, its weights made in ``dtype`` (default: the recipe's master dtype,
    else its compute dtype) with no copy to convert."""
    import torch

    from .precision import RECIPES

    recipe = RECIPES[config.precision]
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype or recipe.master or recipe.param))
    try:
        return _classes()["Model"](config)
    finally:
        torch.set_default_dtype(before)


def loss(output: Any, config: Any) -> Any:
    """The step's loss: cross-entropy over the vocabulary in fp32, as torchtitan's ``loss_fn``
    (``pred.flatten(0, 1).float()``); the MLP's is the sum of its output."""
    import torch
    import torch.nn.functional as F

    if config.kind == "mlp":
        return output.float().sum()
    labels = torch.zeros(output.shape[:2], dtype=torch.long, device=output.device)
    return F.cross_entropy(output.flatten(0, 1).float(), labels.flatten(0, 1))


def bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """``[first, last)`` of each of ``stages`` pipeline stages, as torchtitan splits
    (``generate_split_points``): the first stage gets ``layers // stages``, the middle
    ones one more while layers remain, the last what is left."""
    base, extra = divmod(layers, stages)
    cuts, at = [], 0
    for i in range(stages - 1):
        at += base + (1 if i > 0 and extra > 0 else 0)
        extra -= 1 if i > 0 and extra > 0 else 0
        cuts.append(at)
    edges = [0, *cuts, layers]
    return list(zip(edges[:-1], edges[1:]))


def stage(model: Any, keep: list[int], first: bool, last: bool) -> Any:
    """``model`` cut in place to the blocks ``keep`` (their indices), with the embedding if
    ``first`` and the final norm and head if ``last``: one pipeline rank's layers."""
    from torch import nn

    model.blocks = nn.ModuleList([model.blocks[i] for i in keep])
    if not first:
        model.embed = None
    if not last:
        model.norm = model.head = None
    return model


@cache
def _classes() -> dict[str, type]:
    """The model classes, made on first use so that importing this module needs no torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        """torchtitan's: normalized in fp32, cast back, then scaled."""

        def __init__(self, d: int, eps: float = 1e-5) -> None:
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

        def forward(self, x):
            y = x.float()
            return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def rotary(x, freqs):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)

    def repeat_kv(x, n: int):
        if n == 1:
            return x
        b, s, h, d = x.shape
        return x.unsqueeze(3).expand(b, s, h, n, d).reshape(b, s, h * n, d)

    class LlamaAttention(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.head_dim, self.repeat = c.head_dim, c.heads // c.kv
            self.wq = nn.Linear(c.d_model, c.heads * c.head_dim, bias=False)
            self.wk = nn.Linear(c.d_model, c.kv * c.head_dim, bias=False)
            self.wv = nn.Linear(c.d_model, c.kv * c.head_dim, bias=False)
            self.wo = nn.Linear(c.heads * c.head_dim, c.d_model, bias=False)

        def forward(self, x, freqs):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
            q, k = rotary(q, freqs), rotary(k, freqs)
            k, v = repeat_kv(k, self.repeat), repeat_kv(v, self.repeat)   # -1: this rank's heads
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))

    class SwiGLU(nn.Module):
        def __init__(self, d: int, f: int) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), \
                nn.Linear(d, f, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class LlamaBlock(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.attention_norm, self.attention = RMSNorm(c.d_model), LlamaAttention(c)
            self.ffn_norm, self.feed_forward = RMSNorm(c.d_model), SwiGLU(c.d_model, c.hidden)

        def forward(self, x, freqs):
            h = x + self.attention(self.attention_norm(x), freqs)
            return h + self.feed_forward(self.ffn_norm(h))

    class Attention(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.head_dim = c.head_dim
            self.qkv, self.proj = nn.Linear(c.d_model, 3 * c.d_model), nn.Linear(c.d_model, c.d_model)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).unbind(2)   # -1: this rank's heads
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    class Mlp(nn.Module):
        def __init__(self, d: int, f: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

        def forward(self, x, *unused):
            return self.fc2(torch.relu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(c.d_model), Attention(c)
            self.norm2, self.mlp = nn.LayerNorm(c.d_model), Mlp(c.d_model, c.hidden)

        def forward(self, x, *unused):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        """A whole model or a pipeline stage: what it has of embed, blocks, norm and head
        (``stage`` sets the ones it lacks to None). A stage without the embedding takes the
        hidden states the stage before sent."""

        def __init__(self, c) -> None:
            super().__init__()
            block = {"llama": LlamaBlock, "gpt": Block}.get(c.kind)
            self.embed = nn.Embedding(c.vocab, c.d_model) if block else None
            self.blocks = nn.ModuleList((block(c) if block else Mlp(c.d_model, c.hidden))
                                        for _ in range(c.layers))
            norm = RMSNorm if c.kind == "llama" else nn.LayerNorm
            self.norm = norm(c.d_model) if block else None
            self.head = nn.Linear(c.d_model, c.vocab, bias=False) if block else None
            if c.kind == "llama":       # rotary positions: torchtitan's freqs_cis, theta 500,000
                half = torch.arange(0, c.head_dim, 2).float() / c.head_dim
                angles = torch.outer(torch.arange(c.seq).float(), 1.0 / (500000.0 ** half))
                self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))
            else:
                self.freqs = None

        def forward(self, x):
            if self.embed is not None:
                x = self.embed(x)
            for block in self.blocks:
                x = block(x, self.freqs)
            for part in (self.norm, self.head):
                if part is not None:
                    x = part(x)
            return x

    return {"Model": Model, "Block": Block, "LlamaBlock": LlamaBlock, "Mlp": Mlp}
