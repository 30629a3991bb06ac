"""Mixed precision as torch trains with it: the dtype of each kind of bytes, per recipe.

    RECIPES["bf16-mixed"]      # bf16 compute, fp32 master weights and Adam state
    Config(..., precision="bf16-mixed")

Four dtypes, each set by the recipe (the ZeRO paper's "mixed-precision Adam" is
2Ψ + 2Ψ + 12Ψ bytes for Ψ parameters: bf16 weights, bf16 gradients, and fp32
master weights, momentum and variance):

- ``param``: what forward and backward compute in. DDP and ZeRO-1 keep the model's
  parameters, and so its gradients, in it;
- ``reduce``: the dtype FSDP reduce-scatters gradients in (``MixedPrecisionPolicy``'s
  ``reduce_dtype``); its sharded gradients are then kept as its sharded weights are;
- ``master``: the weights the optimizer updates, when they are not the parameters:
  FSDP2 keeps its *sharded* parameters in it and casts them to ``param`` when it
  gathers them (``MixedPrecisionPolicy(param_dtype=...)``, how torchtitan trains);
  DDP and ZeRO-1 get a copy in the optimizer's state (``MasterWeights``, as
  Megatron's and DeepSpeed's mixed-precision optimizers keep one);
- ``state``: Adam's two moments. torch's Adam makes them ``zeros_like`` the weights it
  updates, so a recipe's ``state`` is its ``master`` (or ``param`` without one).

What torch does on its own, without a recipe: ``torch.autocast`` keeps fp32
parameters and gradients and computes matmuls in bf16 (4Ψ + 4Ψ + 8Ψ: the "fp32"
row's bytes with bf16 activations); the planner has no recipe for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["Precision", "RECIPES", "describe", "master_weights_class"]


@dataclass(frozen=True)
class Precision:
    param: str
    reduce: str
    master: str | None
    state: str

    def bytes(self, kind: str) -> int:
        """Bytes per element of ``kind`` ("param", "reduce", "master", "state")."""
        dtype = getattr(self, kind) or self.param
        return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


RECIPES: dict[str, Precision] = {
    "fp32": Precision("float32", "float32", None, "float32"),
    "bf16": Precision("bfloat16", "bfloat16", None, "bfloat16"),       # pure bf16: 2Ψ + 2Ψ + 4Ψ
    "bf16-mixed": Precision("bfloat16", "float32", "float32", "float32"),
}


def describe(name: str) -> str:
    """One line for a plan's header: what each kind of bytes is kept in."""
    p = RECIPES[name]
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    if p.master:
        return (f"{name}: compute in {short[p.param]}, {short[p.master]} master weights and Adam "
                f"state; gradients {short[p.param]} (ddp, zero1), reduced in {short[p.reduce]} (fsdp)")
    return f"{name}: weights, gradients and Adam state in {short[p.param]}"


@cache
def master_weights_class() -> type:
    """``MasterWeights``, made on first use so that importing this module needs no torch."""
    import torch
    from torch.optim.adam import adam

    class MasterWeights(torch.optim.Optimizer):
        """Adam on ``master``-dtype copies of the model's (bf16) parameters.

        The copies and Adam's two moments live in the optimizer's ``state`` (so
        torch's memory tracker counts them as optimizer state, and a
        ``ZeroRedundancyOptimizer`` shards them with it); each step casts the
        gradients up, runs torch's own functional Adam (``torch.optim.adam.adam``,
        foreach, as on a GPU) on the copies and copies them back into the
        parameters. ``weight_decay`` is decoupled (AdamW) when ``decoupled``.
        """

        def __init__(self, params: Any, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
                     master: str = "float32") -> None:
            super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                      "weight_decay": weight_decay, "decoupled": decoupled})
            self.master = getattr(torch, master)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                for p in params:
                    state = self.state[p]
                    if not state:
                        state["master"] = p.detach().to(self.master, copy=True)
                        state["exp_avg"] = torch.zeros_like(state["master"])
                        state["exp_avg_sq"] = torch.zeros_like(state["master"])
                        state["step"] = torch.tensor(0.0)
                masters = [self.state[p]["master"] for p in params]
                adam(masters, [p.grad.to(self.master) for p in params],
                     [self.state[p]["exp_avg"] for p in params],
                     [self.state[p]["exp_avg_sq"] for p in params], [],
                     [self.state[p]["step"] for p in params], foreach=True,
                     decoupled_weight_decay=group["decoupled"], amsgrad=False,
                     beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                torch._foreach_copy_(params, masters)
            return None

    return MasterWeights

