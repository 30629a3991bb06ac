"""Activation checkpointing of every block, with torch's own ``torch.utils.checkpoint``.

    apply(model, "full")         # each block keeps only its input; backward runs it again
    apply(model, "selective")    # torchtitan's per-op policy: keep matmuls and attention

- ``"full"``: ``checkpoint(block, x, use_reentrant=False)``: the block's forward saves
  nothing for backward but its input, and backward recomputes the whole block first;
- ``"selective"``: the same, with a policy (``create_selective_checkpoint_contexts``)
  that *saves* the outputs of attention and of every other matmul and recomputes the
  rest (norms, activations, the other matmuls): torchtitan's ``selective_ac_option =
  "op"`` (``parallelize_llama.py``, 2024-12), its ``_save_list`` with CPU's attention op
  (``aten._scaled_dot_product_flash_attention_for_cpu``) beside the GPU ones;
- ``"none"``: every block keeps what autograd saves.

The recomputation is real: torch's memory tracker sees the recomputed tensors and
the flop counter counts the recomputed matmuls, so the step's compute includes them.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache
from typing import Any

__all__ = ["apply", "save_list"]


def save_list() -> set:
    """The ops whose outputs selective checkpointing keeps (torchtitan's ``_save_list``)."""
    import torch

    aten = torch.ops.aten
    return {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            aten.abs.default, aten.max.default}


def apply(model: Any, mode: str) -> Any:
    """Wrap each of ``model.blocks`` so that its forward runs under ``torch.utils.checkpoint``
    (``mode`` "full" or "selective"); "none" changes nothing."""
    if mode == "none":
        return model
    from torch import nn

    wrapped = _module_class()
    model.blocks = nn.ModuleList(wrapped(block, mode) for block in model.blocks)
    return model


def _policy(counts: dict[str, int], keep: set) -> Any:
    """torchtitan's ``_custom_policy``: save the ops of ``keep``, except every second mm."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        save = func in keep and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@cache
def _module_class() -> type:
    from torch import nn

    class Checkpointed(nn.Module):
        """A block whose forward runs under ``torch.utils.checkpoint.checkpoint``; its
        parameters are the block's (``.block``)."""

        def __init__(self, block: nn.Module, mode: str) -> None:
            super().__init__()
            self.block, self.mode = block, mode
            self.keep = save_list() if mode == "selective" else set()

        def forward(self, *args: Any) -> Any:
            from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

            if self.mode == "selective":
                def contexts() -> Any:
                    return create_selective_checkpoint_contexts(_policy(defaultdict(int), self.keep))
                return checkpoint(self.block, *args, use_reentrant=False, context_fn=contexts,
                                  preserve_rng_state=False)
            return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=False)

    return Checkpointed
