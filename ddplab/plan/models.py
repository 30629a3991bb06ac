"""The models a plan is made for: a config that builds a Llama- or GPT-shaped transformer (or an MLP).

    CONFIGS["llama3.1-8b"]           # Llama 3.1 8B as torchtitan trains it: bf16-mixed, seq 8192
    CONFIGS["llm-8b"].but(batch=1, checkpointing="full")
    Config(kind="llama", layers=16, d_model=2048, head_dim=64, kv_heads=8, ffn=8192, vocab=128256)

A plan is made from a *config*, not from a built module: the planner builds
the model itself, in a child process, under ``FakeTensorMode`` (tensors with a
shape and no memory), so that a 405B-parameter model costs nothing to "build".
``Config.build()`` gives the same model for real (``ddplab.plan.modules``), which
is what a lab trains when the planner's guess is compared with a measurement
(benchmarks/bench_plan.py).

What a config says besides the shape, each a field:

- ``precision``: the dtypes of parameters, gradients, master weights and Adam's
  state, a recipe of ``ddplab.plan.precision.RECIPES`` ("bf16-mixed": bf16 for
  compute, fp32 master weights and state, as torchtitan and the ZeRO paper train);
- ``checkpointing``: activation checkpointing of every block with torch's own
  ``torch.utils.checkpoint``: "none", "full" or "selective" (``ddplab.plan.recompute``);
- ``batch`` sequences of ``seq`` tokens per data-parallel replica per step, cut
  into micro-batches of ``microbatch`` sequences by a pipeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import ConfigError
from .precision import RECIPES

__all__ = ["CONFIGS", "Config", "named"]

KINDS = ("gpt", "llama", "mlp")
OPTIMIZERS = ("adam", "adamw", "sgd")
CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class Config:
    """A transformer (or MLP) and the batch one data-parallel replica trains per step.

    ``kind="llama"``: token embedding, ``layers`` blocks (RMSNorm, attention with
    ``heads`` query and ``kv_heads`` key/value heads (GQA) and rotary positions,
    RMSNorm, SwiGLU MLP of width ``ffn``), a final RMSNorm and an untied head, no
    biases: torchtitan's Llama 3. ``kind="gpt"``: LayerNorm, one ``qkv`` matrix,
    a ReLU MLP (``ffn``, 4x wide by default), biases. ``kind="mlp"``: ``layers``
    blocks Linear(d, ffn)-ReLU-Linear(ffn, d) on ``batch`` x ``seq`` rows of width
    ``d_model`` (no attention, no embedding): small enough to train on this
    machine's ranks.
    """
    name: str = "custom"
    kind: str = "gpt"               # "gpt", "llama" or "mlp"
    layers: int = 2
    d_model: int = 256
    head_dim: int = 64              # the width of one attention head: heads = d_model / head_dim
    vocab: int = 1000
    seq: int = 128
    batch: int = 8                  # sequences per data-parallel replica per step
    precision: str = "fp32"         # a recipe of ddplab.plan.precision.RECIPES
    optimizer: str = "adam"         # "adam", "adamw" (two states per weight) or "sgd"
    kv_heads: int = 0               # key/value heads (llama's GQA); 0: as many as query heads
    ffn: int = 0                    # the MLP's hidden width; 0: 4 x d_model
    microbatch: int = 1             # sequences per pipeline micro-batch
    checkpointing: str = "none"     # activation checkpointing per block: none, full, selective

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError(f"ddplab.plan: the model config {self.name!r} cannot be built: "
                              + "; ".join(problems) + ".")

    @property
    def heads(self) -> int:
        return self.d_model // self.head_dim

    @property
    def kv(self) -> int:
        """Key/value heads (``kv_heads``, or as many as the query heads)."""
        return self.kv_heads or self.heads

    @property
    def hidden(self) -> int:
        """The MLP's hidden width."""
        return self.ffn or 4 * self.d_model

    @property
    def dtype(self) -> str:
        """The dtype the forward and backward compute in (the recipe's ``param``)."""
        return RECIPES[self.precision].param

    @property
    def microbatches(self) -> int:
        """How many micro-batches a pipeline cuts a replica's batch into."""
        return self.batch // self.microbatch

    @property
    def parameters(self) -> int:
        """How many parameters ``build()`` makes (counted, not traced)."""
        d, f = self.d_model, self.hidden
        if self.kind == "mlp":
            return self.layers * (2 * d * f + f + d)
        if self.kind == "llama":
            attention = 2 * d * d + 2 * d * self.kv * self.head_dim
            return self.layers * (attention + 3 * d * f + 2 * d) + 2 * self.vocab * d + d
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d    # qkv, proj, fc1, fc2, 2 norms
        return self.vocab * d * 2 + self.layers * block + 2 * d

    def to_dict(self) -> dict:
        return asdict(self)

    def but(self, **changes: Any) -> Config:
        """A copy with some fields changed: ``CONFIGS["toy"].but(batch=4)``."""
        unknown = sorted(set(changes) - {f.name for f in fields(Config)})
        if unknown:
            raise ConfigError(_unknown_keys(unknown))
        return replace(self, **changes)

    def build(self) -> Any:
        """The model as an ``nn.Module`` whose ``.blocks`` is an ``nn.ModuleList``, made in the
        dtype its weights are kept in (the master dtype where the recipe has one)."""
        from .modules import build
        return build(self)

    def batch_for(self, batch: int | None = None, device: Any = None) -> Any:
        """An input batch of ``batch`` (default ``self.batch``) sequences: token ids, or rows
        for the MLP."""
        import torch

        n = self.batch if batch is None else batch
        if self.kind == "mlp":
            return torch.randn(n, self.seq, self.d_model, dtype=getattr(torch, self.dtype), device=device)
        return torch.randint(0, self.vocab, (n, self.seq), device=device)


def _problems(c: Config) -> list[str]:
    """What is wrong with ``c``'s fields, each said with the fix; empty if nothing."""
    out = []
    for name in ("layers", "d_model", "head_dim", "vocab", "seq", "batch", "microbatch"):
        value = getattr(c, name)
        if type(value) is not int or value < 1:
            out.append(f"{name} must be a positive int, got {value!r}")
    for name in ("kv_heads", "ffn"):
        value = getattr(c, name)
        if type(value) is not int or value < 0:
            out.append(f"{name} must be an int >= 0 (0: the default), got {value!r}")
    for name, allowed in (("kind", KINDS), ("precision", tuple(RECIPES)), ("optimizer", OPTIMIZERS),
                          ("checkpointing", CHECKPOINTING)):
        if getattr(c, name) not in allowed:
            out.append(f"{name} must be one of {', '.join(allowed)}, got {getattr(c, name)!r}")
    if out:
        return out
    if c.d_model % c.head_dim:
        out.append(f"d_model={c.d_model} does not split into heads of head_dim={c.head_dim}")
    elif c.heads % c.kv:
        out.append(f"{c.heads} query heads do not share kv_heads={c.kv} evenly")
    if c.batch % c.microbatch:
        out.append(f"batch={c.batch} does not split into micro-batches of {c.microbatch}")
    if c.kind == "mlp" and c.checkpointing != "none":
        out.append("the MLP has no blocks worth checkpointing: use checkpointing='none'")
    return out


def _unknown_keys(unknown: list[str]) -> str:
    known = ", ".join(f.name for f in fields(Config))
    hint = " (the dtypes are now one recipe: precision='bf16-mixed', 'bf16' or 'fp32')" \
        if "dtype" in unknown else ""
    return (f"ddplab.plan: unknown model config key{'s' * (len(unknown) > 1)} "
            f"{', '.join(map(repr, unknown))}{hint}; a config has {known}.")


def _llama(name: str, layers: int, d: int, ffn: int, **training: Any) -> Config:
    """A Llama 3.1 shape (torchtitan's ``llama3_configs``: head_dim 128, 8 kv heads, the
    128,256-token vocabulary) and how it is trained."""
    return Config(name, "llama", layers=layers, d_model=d, head_dim=128, kv_heads=8, ffn=ffn,
                  vocab=128256, precision="bf16-mixed", optimizer="adamw", **training)


CONFIGS: dict[str, Config] = {
    "toy": Config("toy", "mlp", layers=4, d_model=256, seq=64, batch=8),
    "toy-wide": Config("toy-wide", "mlp", layers=4, d_model=384, seq=64, batch=8),
    "gpt-tiny": Config("gpt-tiny", layers=2, d_model=256, vocab=1000, seq=128, batch=4),
    # Llama 3.2 1B's shape, its head untied; 4K tokens
    "llm-1b": Config("llm-1b", "llama", layers=16, d_model=2048, head_dim=64, kv_heads=8, ffn=8192,
                     vocab=128256, seq=4096, batch=4, precision="bf16-mixed", optimizer="adamw"),
    # torchtitan's train_configs (2024-12): seq 8192; 8B with selective (per-op) checkpointing,
    # 70B and 405B with full. The batch: its published runs' local batch.
    "llama3.1-8b": _llama("llama3.1-8b", 32, 4096, 14336, seq=8192, batch=2, checkpointing="selective"),
    "llama3.1-70b": _llama("llama3.1-70b", 80, 8192, 28672, seq=8192, batch=16, checkpointing="full"),
    "llama3.1-405b": _llama("llama3.1-405b", 126, 16384, 53248, seq=8192, batch=32, microbatch=4,
                            checkpointing="full"),
}
# the course's 8B: Llama 3.1 8B's shape, 8 sequences of 4K tokens (a 4-stage pipeline has micro-batches
# enough to fill it: torch's 1F1B needs at least as many as stages)
CONFIGS["llm-8b"] = CONFIGS["llama3.1-8b"].but(name="llm-8b", seq=4096, batch=8)


def named(model: Any) -> Config:
    """A Config from a Config, a name in ``CONFIGS`` or a dict of Config's fields."""
    if isinstance(model, Config):
        return model
    if isinstance(model, str) and model in CONFIGS:
        return CONFIGS[model]
    if isinstance(model, dict):
        unknown = sorted(set(model) - {f.name for f in fields(Config)})
        if unknown:
            raise ConfigError(_unknown_keys(unknown))
        return Config(**model)
    raise ConfigError(f"ddplab.plan: cannot plan for {model!r}: give a model config, a name in "
                      f"{', '.join(CONFIGS)} or a Config(layers=..., d_model=...) (from ddplab.plan "
                      f"import Config). A "
                      f"built nn.Module is not taken: the planner builds the model itself, with no "
                      f"memory, under FakeTensorMode.")
