"""The models a plan is made for: a config that builds an LLM-shaped transformer (or an MLP).

    Config(layers=18, d_model=2048, vocab=32000, seq=1024, batch=1)    # about 1.04B parameters
    CONFIGS["llm-1b"], CONFIGS["toy"]                                  # by name

A plan is made from a *config*, not from a built module: the planner builds
the model itself, in a child process, under ``FakeTensorMode`` (tensors with a
shape and no memory), so that a 1B-parameter model costs nothing to "build".
``Config.build()`` gives the same model for real, which is what a lab trains
when the planner's guess is compared with a measurement (benchmarks/bench_plan.py).

The transformer is GPT-shaped: token embedding, ``layers`` blocks (attention:
``qkv`` and ``proj``; MLP: ``fc1`` and ``fc2``, 4x wide), a final norm and an
untied head. Its attention reshapes by ``head_dim``, not by a number of heads,
so tensor parallelism can split ``qkv``/``fc1`` by columns and ``proj``/``fc2``
by rows (Megatron's plan) and each rank simply holds fewer heads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cache
from typing import Any

from ..errors import ConfigError

__all__ = ["CONFIGS", "Config", "named", "stage"]


@dataclass(frozen=True)
class Config:
    """An LLM-shaped model and the batch one data-parallel replica trains per step.

    ``kind="mlp"``: ``layers`` blocks Linear(d, 4d)-ReLU-Linear(4d, d) on
    ``batch`` x ``seq`` rows of width ``d_model`` (no attention, no embedding):
    small enough to train on this machine's ranks.
    """
    name: str = "custom"
    kind: str = "gpt"               # "gpt" or "mlp"
    layers: int = 2
    d_model: int = 256
    head_dim: int = 64
    vocab: int = 1000
    seq: int = 128
    batch: int = 8                  # sequences per data-parallel replica per step
    dtype: str = "float32"          # parameters, gradients and activations
    optimizer: str = "adam"         # "adam" (two states per parameter) or "sgd"

    @property
    def parameters(self) -> int:
        """How many parameters ``build()`` makes (counted, not traced)."""
        d = self.d_model
        block = 12 * d * d + 13 * d                 # qkv, proj, fc1, fc2 weights+biases, 2 norms
        if self.kind == "mlp":
            return self.layers * (8 * d * d + 5 * d)
        return self.vocab * d * 2 + self.layers * block + 2 * d

    def to_dict(self) -> dict:
        return asdict(self)

    def but(self, **changes: Any) -> Config:
        """A copy with some fields changed: ``CONFIGS["toy"].but(batch=4)``."""
        return replace(self, **changes)

    def build(self) -> Any:
        """The model as an ``nn.Module`` whose ``.blocks`` is an ``nn.ModuleList``."""
        import torch

        before = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, self.dtype))   # made in its dtype: no copy to convert
        try:
            return _modules()["Model"](self)
        finally:
            torch.set_default_dtype(before)

    def batch_for(self, batch: int | None = None, device: Any = None) -> Any:
        """An input batch of ``batch`` (default ``self.batch``) sequences."""
        import torch

        n = self.batch if batch is None else batch
        if self.kind == "mlp":
            return torch.randn(n, self.seq, self.d_model, dtype=getattr(torch, self.dtype), device=device)
        return torch.randint(0, self.vocab, (n, self.seq), device=device)


CONFIGS: dict[str, Config] = {
    "toy": Config("toy", "mlp", layers=4, d_model=256, seq=64, batch=8),
    "toy-wide": Config("toy-wide", "mlp", layers=4, d_model=384, seq=64, batch=8),
    "gpt-tiny": Config("gpt-tiny", layers=2, d_model=256, vocab=1000, seq=128, batch=4),
    "llm-1b": Config("llm-1b", layers=16, d_model=2048, head_dim=128, vocab=50304, seq=1024,
                     batch=8, dtype="bfloat16"),
    "llm-8b": Config("llm-8b", layers=32, d_model=4096, head_dim=128, vocab=128000, seq=4096,
                     batch=8, dtype="bfloat16"),
}


def named(model: Any) -> Config:
    """A Config from a Config, a name in ``CONFIGS`` or a dict of Config's fields."""
    if isinstance(model, Config):
        return model
    if isinstance(model, str) and model in CONFIGS:
        return CONFIGS[model]
    if isinstance(model, dict):
        return Config(**model)
    raise ConfigError(f"ddplab.plan: cannot plan for {model!r}: give a model config, a name in "
                      f"{', '.join(CONFIGS)} or a ddplab.plan.Config(layers=..., d_model=...). A "
                      f"built nn.Module is not taken: the planner builds the model itself, with no "
                      f"memory, under FakeTensorMode.")


@cache
def _modules() -> dict[str, type]:
    """The model classes, made on first use so that importing this module needs no torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, c: Config) -> None:
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
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self, c: Config) -> None:
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(c.d_model), Attention(c)
            self.norm2, self.mlp = nn.LayerNorm(c.d_model), Mlp(c.d_model)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        """A whole model or a pipeline stage: what it has of embed, blocks, norm and head
        (``stage`` sets the ones it lacks to None)."""

        def __init__(self, c: Config) -> None:
            super().__init__()
            gpt = c.kind != "mlp"
            self.embed = nn.Embedding(c.vocab, c.d_model) if gpt else None
            self.blocks = nn.ModuleList((Block(c) if gpt else Mlp(c.d_model)) for _ in range(c.layers))
            self.norm = nn.LayerNorm(c.d_model) if gpt else None
            self.head = nn.Linear(c.d_model, c.vocab, bias=False) if gpt else None

        def forward(self, x):
            for part in (self.embed, *self.blocks, self.norm, self.head):
                if part is not None:
                    x = part(x)
            return x

    return {"Model": Model, "Block": Block, "Mlp": Mlp}


def stage(model: Any, first: int, last: int) -> Any:
    """Pipeline stage ``[first, last)`` of ``model``'s blocks, in place: the first stage keeps
    the embedding, the last the norm and head, and the blocks of the others are dropped."""
    from torch import nn

    count = len(model.blocks)
    model.blocks = nn.ModuleList(list(model.blocks)[first:last])
    if first > 0:
        model.embed = None
    if last < count:
        model.norm = model.head = None
    return model
