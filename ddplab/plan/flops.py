"""FLOPs of a training step, counted by torch's ``FlopCounterMode``, attention included.

    count(model_step)        # {"flops": ..., "uncounted": ["aten.foo", ...]}

torch 2.13's counter has formulas for matmuls, convolutions and the GPU attention
kernels, but not for the op ``scaled_dot_product_attention`` runs on a CPU,
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward): it would
count them as 0, about an eighth of an 8B model's step at 8K tokens (causal). ``register()`` adds
formulas for both with torch's registration API (``register_flop_formula``):

- forward: Q·Kᵀ and P·V, 2 FLOPs per multiply-add over the (query, key) pairs that
  attend; with ``is_causal`` only the pairs on or below the diagonal (torch's
  top-left causal mask: query i sees keys 0..i), about half of them;
- backward: torch's own five products (``sdpa_backward_flop_count``: the scores
  recomputed, dP, dV, dQ, dK) over the same pairs.

Without a causal mask the counts are torch's ``sdpa_flop_count`` and
``sdpa_backward_flop_count`` exactly. torch's formulas for the GPU kernels do not
halve causal attention ("NB: We aren't accounting for causal attention here").

Any other op the counter has no formula for, and that is not elementwise, a view
or a copy, is returned in ``uncounted`` and listed in the plan's sources, never
silently zero (norms' reductions, the softmax of the loss, the embedding's gather:
memory-bound work that the efficiency lumps in).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

__all__ = ["attention_flops", "causal_pairs", "count", "register", "stage"]

# ops that move or make data and compute nothing worth a FLOP (not counted by torch either)
_DATA = ("view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze",
         "clone", "copy", "_to_copy", "detach", "alias", "lift_fresh", "contiguous", "slice",
         "select", "unbind", "split", "split_with_sizes", "cat", "stack", "flatten", "unflatten",
         "empty", "zeros", "ones", "full", "fill", "zero", "new_empty", "new_zeros", "new_ones",
         "new_full", "new_empty_strided", "empty_strided", "empty_like", "zeros_like", "ones_like",
         "full_like", "randint", "randn", "rand", "arange", "scalar_tensor", "view_as_real",
         "view_as_complex", "_unsafe_view", "as_strided", "_reshape_alias", "set_", "resize_",
         "_local_scalar_dense", "embedding", "embedding_dense_backward", "narrow", "index_select",
         "_foreach_copy", "copy_", "detach_", "split_with_sizes_copy", "expand_copy", "_conj",
         "conj", "resolve_conj", "_neg_view")


def causal_pairs(queries: int, keys: int) -> int:
    """(query, key) pairs a top-left causal mask lets attend: query i sees keys 0..i."""
    full = min(queries, keys)                 # rows 0..full-1 see i+1 keys, the rest all keys
    return full * (full + 1) // 2 + (queries - full) * keys


def attention_flops(q: tuple, k: tuple, v: tuple, causal: bool, backward: bool = False) -> int:
    """FLOPs of one attention call on shapes (batch, heads, seq, head_dim); GQA's key/value
    heads are broadcast to the query heads, as the kernel does."""
    b, h, sq, d = q
    sk, dv = k[2], v[3]
    pairs = causal_pairs(sq, sk) if causal else sq * sk
    per_pair = 2 * (3 * d + 2 * dv) if backward else 2 * (d + dv)
    return b * h * pairs * per_pair


def register() -> None:
    """Formulas for CPU's flash attention, forward and backward, in torch's flop registry;
    where torch has its own (a later torch), torch's is kept."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward, backward = (aten._scaled_dot_product_flash_attention_for_cpu,
                         aten._scaled_dot_product_flash_attention_for_cpu_backward)
    if forward not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(forward)
        def _forward(q, k, v, dropout_p=0.0, is_causal=False, *args, attn_mask=None, scale=None,
                     out_shape=None, **kwargs) -> int:
            return attention_flops(q, k, v, bool(is_causal) and attn_mask is None)
    if backward not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(backward)
        def _backward(grad_out, q, k, v, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                      attn_mask=None, scale=None, out_shape=None, **kwargs) -> int:
            return attention_flops(q, k, v, bool(is_causal) and attn_mask is None, backward=True)


def count(step: Callable[[], Any]) -> dict[str, Any]:
    """Run ``step()`` under ``FlopCounterMode``: {"flops": the total, "uncounted": the ops it
    ran that the counter has no formula for and that compute (sorted names)}."""
    from torch.utils import flop_counter
    from torch.utils._python_dispatch import TorchDispatchMode

    register()
    seen: set = set()

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with flop_counter.FlopCounterMode(display=False) as counter, Seen():
        step()
    return {"flops": int(counter.get_total_flops()),
            "uncounted": sorted(str(op) for op in seen if _computes(op, flop_counter.flop_registry))}


def _computes(op: Any, registry: dict) -> bool:
    """Whether ``op`` computes something the counter leaves out: not in its registry, not
    elementwise (torch's ``pointwise`` tag), not a view, copy or factory, not a collective."""
    import torch

    if op in registry:
        return False
    name = op.__name__.rstrip("_")
    if name in _DATA or name.startswith("_foreach_") or str(op).split(".")[0] in ("_c10d_functional",
                                                                                  "c10d", "prim"):
        return False
    tags = set()
    for overload in op.overloads():
        tags.update(getattr(op, overload).tags)
    return torch.Tag.pointwise not in tags and torch.Tag.view_copy not in tags


def stage(config: Any, pp: int = 1, virtual: int = 1, rank: int = 0) -> dict[str, Any]:
    """FLOPs of one micro-batch's forward and backward (the whole batch without a pipeline)
    on pipeline rank ``rank``'s layers, checkpointing's recomputation included, tensor
    parallelism not applied (it divides every matmul and attention evenly).

    Counted on two models, the rank's ends with one block and with two: the blocks are
    identical, so the count is the first plus (blocks - 1) times the difference, the same
    number a model of every block gives (``tests/test_plan_flops.py`` checks that) at the
    cost of two blocks."""
    return _stage(config, pp, virtual, rank)


@cache
def _stage(config: Any, pp: int, virtual: int, rank: int) -> dict[str, Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import pipeline_schedule as schedule, recompute
    from .modules import build, loss

    blocks = len(schedule.layers_of(config.layers, pp, virtual, rank)) if pp > 1 else config.layers
    first, last = rank == 0, rank == pp - 1
    sequences = config.microbatch if pp > 1 else config.batch
    counts = []
    for n in sorted({1, min(2, blocks)}):
        small = config.but(layers=n)
        with FakeTensorMode():
            model = build(small, small.dtype)
            if not first:
                model.embed = None
            if not last:
                model.norm = model.head = None
            recompute.apply(model, config.checkpointing)
            x = (small.batch_for(sequences) if first else
                 torch.randn(sequences, config.seq, config.d_model, dtype=getattr(torch, small.dtype),
                             requires_grad=True))

            def step(model: Any = model, x: Any = x, small: Any = small) -> None:
                out = model(x)
                (loss(out, small) if last else out.float().sum()).backward()
            counts.append(count(step))
    one, two = counts[0], counts[-1]
    total = one["flops"] + (blocks - 1) * (two["flops"] - one["flops"])
    return {"flops": total, "uncounted": sorted(set(one["uncounted"]) | set(two["uncounted"]))}
