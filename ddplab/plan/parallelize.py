"""A strategy applied to a model with torch's own code, in torchtitan's order: tp, checkpointing,
then fsdp; and the optimizer each data-parallel strategy gets.

    tensor_parallel(model, config, mesh["tp"])    # parallelize_module: Megatron's plan
    recompute.apply(model, config.checkpointing)
    fully_shard_all(model, config, strategy, mesh["dp"])
    optimizer(model, config, strategy, mesh["dp"])

- tp on Llama is torchtitan's ``apply_tp`` (2024-12): ``wq``/``wk``/``wv``/``w1``/``w3``
  column-wise, ``wo``/``w2`` row-wise, the norms and the residual stream sequence-parallel
  (``SequenceParallel``: each rank holds seq/T of them), the embedding row-wise and the
  head column-wise with the vocabulary left sharded for ``loss_parallel``; on GPT and the
  MLP, the column/row split of the two matmul pairs only;
- fsdp: ``fully_shard`` on every block, then the root, with a ``MixedPrecisionPolicy``
  where the recipe keeps master weights (sharded weights in the master dtype, gathered
  in the compute dtype). As torchtitan: the last block is not resharded after forward
  (backward needs it at once), and under a pipeline no block is (each micro-batch would
  gather it again);
- zero2: ``fully_shard`` with ``reshard_after_forward=False`` (FSDP1 called it
  ``SHARD_GRAD_OP``, "ZeRO-2"): a block's weights, once gathered for the forward, stay
  whole until its backward; gradients and optimizer state are sharded;
- zero1: ``ZeroRedundancyOptimizer``: each rank updates whole parameters, 1/D of them
  by size, and broadcasts them (so one parameter bigger than 1/D of the model is a
  rank's share on its own);
- ddp: the local model (DDP's C++ reducer cannot hold fake tensors): its gradients
  are the buckets with ``gradient_as_bucket_view=True``.
"""

from __future__ import annotations

from typing import Any

from .precision import RECIPES, master_weights_class

__all__ = ["OnShards", "fully_shard_all", "optimizer", "tensor_parallel"]

_PLAIN = {"gpt": {"attn.qkv": "col", "attn.proj": "row", "mlp.fc1": "col", "mlp.fc2": "row"},
          "mlp": {"fc1": "col", "fc2": "row"}}


def tensor_parallel(model: Any, config: Any, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if config.kind != "llama":
        style = {"col": ColwiseParallel, "row": RowwiseParallel}
        plan = {name: style[how]() for name, how in _PLAIN[config.kind].items()}
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    ends = {}
    if model.embed is not None:
        ends["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        ends["norm"] = SequenceParallel()
        ends["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                       use_local_output=False)
    if ends:
        parallelize_module(model, mesh, ends)
    layer = {"attention_norm": SequenceParallel(),
             "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                             desired_input_layouts=(Replicate(), None)),
             "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
             "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
             "ffn_norm": SequenceParallel(),
             "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),)),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    for block in model.blocks:
        parallelize_module(block, mesh, layer)


def fully_shard_all(model: Any, config: Any, strategy: Any, mesh: Any) -> None:
    """FSDP2 on each block and the root, as torchtitan's ``apply_fsdp``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    recipe = RECIPES[config.precision]
    options: dict[str, Any] = {"mesh": mesh}
    if recipe.master:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, recipe.param),
                                                    reduce_dtype=getattr(torch, recipe.reduce))
    keep = strategy.data == "zero2" or strategy.pp > 1
    for i, block in enumerate(model.blocks):
        fully_shard(block, reshard_after_forward=not keep and i < len(model.blocks) - 1, **options)
    fully_shard(model, reshard_after_forward=not keep, **options)


def optimizer(model: Any, config: Any, strategy: Any, mesh: Any) -> Any:
    """The optimizer of ``config`` for ``strategy``: torch's Adam/AdamW (foreach, as on a GPU)
    on the weights it holds; ``MasterWeights`` where the recipe keeps master weights that the
    parameters are not (ddp, zero1); wrapped in ``ZeroRedundancyOptimizer`` for zero1."""
    import torch
    from torch.distributed.tensor import DTensor

    recipe = RECIPES[config.precision]
    options: dict[str, Any] = {"lr": 1e-3}
    if config.optimizer == "sgd":
        kind, options = torch.optim.SGD, {"lr": 1e-3, "momentum": 0.0}
    elif recipe.master and strategy.data in ("ddp", "zero1"):
        kind = master_weights_class()
        options.update(master=recipe.master, decoupled=config.optimizer == "adamw")
    else:
        kind = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
        options["foreach"] = True
    if strategy.data == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        options.pop("foreach", None)
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind,
                                       process_group=mesh.get_group(), **options)
    params = list(model.parameters())
    if any(isinstance(p, DTensor) for p in params):
        return OnShards(params, lambda local: kind(local, **options))
    return kind(params, **options)


class OnShards:
    """torch's optimizer stepping each DTensor parameter's local shard, as DTensor's foreach ops
    end up doing on every rank: the same state, the same temporaries, the same bytes (a test
    compares them), without DTensor's sharding propagation for each foreach op, which on fake
    tensors was most of a plan's time and allocates nothing. ``inner`` is the torch optimizer
    (the one a memory tracker hooks)."""

    def __init__(self, params: list, make: Any) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        with torch.no_grad():                       # to_local() without autograd: the shard itself
            self.pairs = [(p, p.to_local() if isinstance(p, DTensor) else p) for p in params]
        self.inner = make([local for _, local in self.pairs])

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p, local in self.pairs:
                if local is not p:
                    grad = p.grad
                    if grad is not None and grad.placements != p.placements:   # e.g. a replicated
                        grad = grad.redistribute(p.device_mesh, p.placements)     # embedding's grad
                    local.grad = None if grad is None else grad.to_local()
        self.inner.step()

    def zero_grad(self) -> None:
        for p, local in self.pairs:
            p.grad = local.grad = None
