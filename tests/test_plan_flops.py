"""The step's FLOPs: CPU's flash attention counted (it was 0 before), checked against the analytic
count; ops without a formula listed, never silently zero; a stage counted from two blocks."""

from __future__ import annotations

import pytest

from ddplab.plan import Config, flops


def one_call(q, k, causal: bool, backward: bool = False) -> dict:
    """FlopCounterMode's count of one scaled_dot_product_attention on CPU (fake tensors)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        query = torch.randn(*q, requires_grad=True)
        key, value = torch.randn(*k, requires_grad=True), torch.randn(*k, requires_grad=True)

        def step():
            out = F.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                                 enable_gqa=q[1] != k[1])
            if backward:
                out.sum().backward()
        return flops.count(step)


def test_one_causal_call_counts_its_half_of_the_pairs():
    """b=1, 32 heads, 1,024 tokens, head_dim 128: QKᵀ and PV over the 1024·1025/2 pairs that
    attend, 2 FLOPs a multiply-add (torch 2.13 counted 0 for this op on a CPU)."""
    b, h, s, d = 1, 32, 1024, 128
    got = one_call((b, h, s, d), (b, h, s, d), causal=True)
    assert got["flops"] == b * h * (s * (s + 1) // 2) * 2 * (d + d)
    assert not any("attention" in op for op in got["uncounted"])


def test_without_a_mask_the_counts_are_torchs_own_formulas():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k = (2, 8, 256, 64), (2, 2, 512, 64)             # GQA: 2 key/value heads for 8 query heads
    forward = one_call(q, k, causal=False)["flops"]
    both = one_call(q, k, causal=False, backward=True)["flops"]
    assert forward == sdpa_flop_count(q, k, k)
    assert both - forward == sdpa_backward_flop_count(q, q, k, k)


@pytest.mark.parametrize("queries, keys", [(4, 4), (3, 7), (7, 3), (1, 1)])
def test_causal_pairs_follow_torchs_top_left_mask(queries, keys):
    import torch

    mask = torch.ones(queries, keys, dtype=torch.bool).tril()    # torch's is_causal mask
    assert flops.causal_pairs(queries, keys) == int(mask.sum())


def test_an_op_without_a_formula_is_listed(monkeypatch):
    """Take the attention formula away: the op is listed as uncounted, not silently 0."""
    import torch
    from torch.utils import flop_counter

    registry = dict(flop_counter.flop_registry)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    registry.pop(op, None)
    monkeypatch.setattr(flop_counter, "flop_registry", registry)
    monkeypatch.setattr(flops, "register", lambda: None)
    got = one_call((1, 2, 16, 8), (1, 2, 16, 8), causal=True)
    assert got["flops"] == 0 and "aten._scaled_dot_product_flash_attention_for_cpu" in got["uncounted"]


LLAMA = Config("t", "llama", layers=6, d_model=256, head_dim=64, kv_heads=2, ffn=512, vocab=1000,
               seq=64, batch=2, precision="bf16-mixed")


def whole(config: Config, first: bool = True, last: bool = True) -> dict:
    """Every block counted, the way flops.stage avoids."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ddplab.plan import recompute
    from ddplab.plan.modules import build, loss

    with FakeTensorMode():
        model = build(config, config.dtype)
        if not first:
            model.embed = None
        if not last:
            model.norm = model.head = None
        recompute.apply(model, config.checkpointing)
        x = config.batch_for() if first else torch.randn(config.batch, config.seq, config.d_model,
                                                         dtype=torch.bfloat16, requires_grad=True)

        def step():
            out = model(x)
            (loss(out, config) if last else out.float().sum()).backward()
        return flops.count(step)


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_a_stage_counted_from_two_blocks_is_the_whole_count(checkpointing):
    config = LLAMA.but(checkpointing=checkpointing)
    assert flops.stage(config) == whole(config)


def test_a_pipeline_rank_is_counted_on_its_own_blocks():
    config = LLAMA.but(layers=8, batch=4)                      # micro-batches of 1 sequence
    first = flops.stage(config, pp=2, virtual=1, rank=0)
    last = flops.stage(config, pp=2, virtual=1, rank=1)
    one = config.but(layers=4, batch=1)
    assert first == whole(one, last=False) and last == whole(one, first=False)


def test_the_count_is_the_analytic_one():
    """6 FLOPs per weight per token in the matmuls, less the embedding (a lookup), plus attention
    forward and backward over the causal pairs; recomputation adds most of a forward."""
    c = LLAMA
    tokens, d, f, kv = c.batch * c.seq, c.d_model, c.hidden, c.kv * c.head_dim
    matmuls = c.layers * (2 * d * d + 2 * d * kv + 3 * d * f) + d * c.vocab
    q = (c.batch, c.heads, c.seq, c.head_dim)
    attention = c.layers * (flops.attention_flops(q, q, q, True) + flops.attention_flops(q, q, q, True, True))
    assert flops.stage(c)["flops"] == 6 * tokens * matmuls + attention
    # full recomputes each block's forward up to what backward needs: torch's non-reentrant
    # checkpoint stops early (early_stop), before the last matmul (w2), whose output nothing saves
    recomputed = 2 * tokens * (2 * d * d + 2 * d * kv + 2 * d * f) + flops.attention_flops(q, q, q, True)
    assert flops.stage(c.but(checkpointing="full"))["flops"] == \
        6 * tokens * matmuls + attention + c.layers * recomputed
    assert set(flops.stage(c)["uncounted"]) >= {"aten._log_softmax", "aten.nll_loss_forward"}
