"""The notebook-14 checkers: ring attention, Ulysses and expert parallelism, compared with one process.

For each check: the reference solution passes, the stub fails, and plausible wrong solutions
fail with a message naming the mistake (a merge without the running max, a causal mask not offset
by the block's place or off by one block, K/V gathered instead of sent round the ring, no overlap,
future blocks not skipped, pieces reshaped without a permute, split sizes not exchanged, tokens
combined out of order, a balance loss of one rank's tokens or of averaged losses).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from conftest import fails

from ddplab import attention
from ddplab.check.nb14_long_sequences_and_experts import attention_checks as check, experts as moe_check

pytestmark = pytest.mark.slow


# ------------------------------------------------------- the reference solutions
def lse_merge(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    lse = m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
            + torch.exp(lse_b - lse).unsqueeze(-1) * out_b), lse


def ring_attention(q, k, v, causal, offset=0, skip=True, overlap=True, right=1, local_mask=False):
    """The notebook's ring; the keyword arguments make it wrong."""
    rank, p = dist.get_rank(), dist.get_world_size()
    b = q.shape[-2]
    kv = torch.stack([k, v])
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nxt = torch.empty_like(kv)
            reqs = [dist.isend(kv, dst=(rank + right) % p), dist.irecv(nxt, src=(rank - right) % p)]
            if not overlap:
                for r in reqs:
                    r.wait()
                reqs = []
        if not (causal and skip and src > rank):
            mask = None
            if causal:
                qpos = (0 if local_mask else rank) * b + torch.arange(b)
                kpos = (0 if local_mask else src + offset) * b + torch.arange(b)
                mask = kpos[None, :] <= qpos[:, None]
            o, lse_blk = attention.block(q, kv[0], kv[1], mask)
            m = torch.maximum(lse, lse_blk)
            new = m + torch.log(torch.exp(lse - m) + torch.exp(lse_blk - m))
            out = torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_blk - new).unsqueeze(-1) * o
            lse = new
        if step < p - 1:
            for r in reqs:
                r.wait()
            kv = nxt
    return out


def seq_to_heads(x, permute=True):
    p = dist.get_world_size()
    h, b, d = x.shape
    got = torch.empty_like(x)
    dist.all_to_all_single(got, x)                       # piece j (heads chunk j) to rank j
    if permute:
        return got.view(p, h // p, b, d).permute(1, 0, 2, 3).reshape(h // p, p * b, d)
    return got.reshape(h // p, p * b, d)


def heads_to_seq(x):
    p = dist.get_world_size()
    hp, s, d = x.shape
    pieces = x.view(hp, p, s // p, d).permute(1, 0, 2, 3).contiguous()
    got = torch.empty_like(pieces)
    dist.all_to_all_single(got, pieces)
    return got.reshape(p * hp, s // p, d)


def moe_layer(x, idx, gates, experts, exchange=True, unsort=True, weigh=True):
    p = dist.get_world_size()
    per = len(experts)
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] >= 0]                           # dropped assignments go nowhere
    rows, where = x[order // k], flat[order]
    sends = torch.bincount(where // per, minlength=p)
    if exchange:
        recvs = torch.empty_like(sends)
        dist.all_to_all_single(recvs, sends)
    else:
        recvs = sends
    got = x.new_empty(int(recvs.sum()), x.shape[1])
    dist.all_to_all_single(got, rows, recvs.tolist(), sends.tolist())
    got_expert = torch.empty(int(recvs.sum()), dtype=torch.long)
    dist.all_to_all_single(got_expert, where, recvs.tolist(), sends.tolist())
    done = torch.empty_like(got)
    for e, expert in experts.items():
        mine = got_expert == e
        done[mine] = expert(got[mine])
    back = torch.empty_like(rows)
    dist.all_to_all_single(back, done, sends.tolist(), recvs.tolist())
    y = torch.zeros(len(flat), x.shape[1], dtype=x.dtype)
    if unsort:
        y[order] = back
    else:
        y[:len(back)] = back
    w = gates.reshape(-1, 1) if weigh else torch.ones(len(flat), 1, dtype=x.dtype)
    return (y * w).view(len(x), k, -1).sum(1)


def balance_loss(probs, idx, average=False, local=False):
    e, k = probs.shape[1], idx.shape[1]
    if average or local:
        f = torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype) / (len(probs) * k)
        loss = e * (f * probs.mean(0)).sum()
        if local:
            return loss
        dist.all_reduce(loss)
        return loss / dist.get_world_size()
    stats = torch.cat([torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype), probs.sum(0),
                       torch.tensor([float(len(probs))], dtype=probs.dtype)])
    dist.all_reduce(stats)
    f, prob = stats[:e] / (stats[-1] * k), stats[e:2 * e] / stats[-1]
    return e * (f * prob).sum()


def stub(*args):
    raise NotImplementedError()


# -------------------------------------------------------------- wrong solutions
def merge_without_max(out_a, lse_a, out_b, lse_b):
    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))
    return torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b, lse


def merge_averaged(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, lse_merge(out_a, lse_a, out_b, lse_b)[1]


def ring_gathered(q, k, v, causal):
    """K and V sent all round the ring, then attention over the gathered sequence."""
    rank, p = dist.get_rank(), dist.get_world_size()
    blocks, kv = {rank: torch.stack([k, v])}, torch.stack([k, v])
    for step in range(1, p):
        nxt = torch.empty_like(kv)
        reqs = [dist.isend(kv, dst=(rank + 1) % p), dist.irecv(nxt, src=(rank - 1) % p)]
        for r in reqs:
            r.wait()
        kv = blocks[(rank - step) % p] = nxt
    whole = torch.cat([blocks[i] for i in range(p)], dim=-2)
    b = q.shape[-2]
    scores = q @ whole[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(p * b, p * b, dtype=torch.bool).tril()[rank * b:(rank + 1) * b]
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ whole[1]


def ring_all_gather(q, k, v, causal):
    p = dist.get_world_size()
    ks = [torch.empty_like(k) for _ in range(p)]
    dist.all_gather(ks, k)
    return ring_attention(q, k, v, causal)


# --------------------------------------------------------------------- the tests


@pytest.mark.parametrize("checker, answer, words", [
    (check.lse_merge, lse_merge, "lse_merge equals attention over both blocks"),
    (check.ring_attention, ring_attention, "ring_attention equals attention over the whole sequence"),
    (lambda fn: check.ulysses(fn, heads_to_seq), seq_to_heads, "re-shard with all_to_all"),
    (moe_check.moe_layer, moe_layer, "moe_layer equals one process's mixture of experts"),
    (moe_check.balance_loss, balance_loss, "balance_loss gives every rank the loss of all"),
])
def test_the_reference_passes(fresh_lab, capsys, checker, answer, words):
    checker(answer)
    assert words in capsys.readouterr().out


@pytest.mark.parametrize("checker", [check.lse_merge, check.ring_attention,
                                     lambda fn: check.ulysses(fn, heads_to_seq),
                                     lambda fn: check.ulysses(seq_to_heads, fn),
                                     moe_check.moe_layer, moe_check.balance_loss])
def test_the_stub_fails_with_not_implemented(fresh_lab, checker):
    message = fails(lambda: checker(stub), "in stub)", "It raised ")
    assert message.startswith("NotImplementedError ("), message


@pytest.mark.parametrize("wrong, words", [
    (merge_without_max, "a merge without the running max"),
    (merge_averaged, "the two outputs were averaged"),
])
def test_lse_merge_mistakes_named(fresh_lab, wrong, words):
    message = fails(lambda: check.lse_merge(wrong), words)
    # The hint names what the merge must do, never the formula that is the answer (issue 53).
    for formula in ("log(exp(", "exp(lse_a - ", "m = max(", "exp(lse_block - lse_merged)"):
        assert formula not in message, message


def ring_attention_one_float32_cast(q, k, v, causal):
    """A correct ring whose blocks' products run in float32 once (picotron's ring attention with
    one cast, issue 53): told to fix its merge before; off by float32's rounding only."""
    real = attention.block

    def block(q, k, v, mask=None):
        out, lse = real(q.float(), k.float(), v.float(), mask)
        return out.double(), lse.double()
    attention.block = block
    try:
        return ring_attention(q, k, v, causal)
    finally:
        attention.block = real


def test_ring_attention_computed_in_float32_once_is_named_as_precision(fresh_lab):
    message = fails(lambda: check.ring_attention(ring_attention_one_float32_cast),
                    "only by float32's rounding: your code computes in float32 somewhere.",
                    "Hint: keep every step in float64")
    assert "merge each block" not in message and "log-sum-exp" not in message, message   # not the merge
    assert "elements differ, by up to " in message       # its values against the reference


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: ring_attention(*a, offset=-1), "one block off (the block taken for the previous"),
    (lambda *a: ring_attention(*a, offset=1), "one block off (the block taken for the next"),
    (lambda *a: ring_attention(*a, overlap=False), "no overlap"),
    (lambda *a: ring_attention(*a, skip=False), "skip it"),
    (ring_gathered, "a product over the whole sequence"),
    (ring_all_gather, "may not call dist.all_gather"),
])
def test_ring_attention_mistakes_named(fresh_lab, wrong, words):
    message = fails(lambda: check.ring_attention(wrong), words)
    assert "cannot be checked" not in message          # the refusal itself, not a traceback per rank


def test_ring_attention_mask_not_offset_named(fresh_lab):
    fails(lambda: check.ring_attention(lambda *a: ring_attention(*a, local_mask=True)),
          "ring_attention(causal=True) on rank 1", "the mask was not offset by the block's place")


def test_ulysses_reshape_without_permute_named(fresh_lab):
    fails(lambda: check.ulysses(lambda x: seq_to_heads(x, permute=False), heads_to_seq),
          "seq_to_heads on rank", "reshaped without moving the rank dimension")


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: moe_layer(*a, exchange=False), "split sizes not exchanged"),
    (lambda *a: moe_layer(*a, unsort=False), "tokens combined out of order"),
    (lambda *a: moe_layer(*a, weigh=False), "the gates were not applied"),
])
def test_moe_layer_mistakes_named(fresh_lab, wrong, words):
    message = fails(lambda: moe_check.moe_layer(wrong), words)
    assert "cannot be checked" not in message


@pytest.mark.parametrize("wrong, words", [
    (lambda probs, idx: balance_loss(probs, idx, average=True), "the ranks' losses were averaged"),
    (lambda probs, idx: balance_loss(probs, idx, local=True), "this rank's tokens only"),
])
def test_balance_loss_mistakes_named(fresh_lab, wrong, words):
    fails(lambda: moe_check.balance_loss(wrong), words)


def seq_to_heads_by_all_gather(x):
    """Every rank's whole slice gathered, then this rank's heads picked out: not a re-shard."""
    p, rank = dist.get_world_size(), dist.get_rank()
    slices = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(slices, x)
    return torch.cat(slices, dim=1).chunk(p, dim=0)[rank]


def seq_to_heads_by_all_to_all_of_everything(x):
    """all_to_all as an all_gather: the whole slice to every rank, then this rank's heads picked out."""
    p, rank = dist.get_world_size(), dist.get_rank()
    slices = [torch.empty_like(x) for _ in range(p)]
    dist.all_to_all(slices, [x] * p)
    return torch.cat(slices, dim=1).chunk(p, dim=0)[rank]


def ring_softmax_over_gathered_scores(q, k, v, causal):
    """K/V round the ring, each block's scores kept, one softmax over them all: no merge."""
    rank, p = dist.get_rank(), dist.get_world_size()
    kv, blocks = torch.stack([k, v]), {}
    for step in range(p):
        blocks[(rank - step) % p] = kv
        if step < p - 1:
            nxt = torch.empty_like(kv)
            reqs = [dist.isend(kv, dst=(rank + 1) % p), dist.irecv(nxt, src=(rank - 1) % p)]
            scores_now = q @ kv[0].transpose(-2, -1)          # some compute while it travels
            for r in reqs:
                r.wait()
            kv = nxt
    del scores_now
    scores = torch.cat([q @ blocks[s][0].transpose(-2, -1) / math.sqrt(q.shape[-1]) for s in range(p)], -1)
    weights = torch.softmax(scores, -1)
    b = q.shape[-2]
    return sum(weights[..., s * b:(s + 1) * b] @ blocks[s][1] for s in range(p))


def balance_by_all_gather(probs, idx):
    p = dist.get_world_size()
    gathered = [torch.empty_like(probs) for _ in range(p)]
    dist.all_gather(gathered, probs)
    return balance_loss(probs, idx)


def test_ulysses_by_an_all_to_all_of_everything_is_named(fresh_lab):
    fails(lambda: check.ulysses(seq_to_heads_by_all_to_all_of_everything, heads_to_seq),
          "more than the slice itself", "is an all_gather")


def test_ring_softmax_over_the_gathered_scores_is_refused(fresh_lab):
    fails(lambda: check.ring_attention(ring_softmax_over_gathered_scores),
          "a softmax over scores as long as the whole sequence")


@pytest.mark.parametrize("run", [lambda: check.ulysses(seq_to_heads_by_all_gather, heads_to_seq),
                                 lambda: moe_check.balance_loss(balance_by_all_gather)])
def test_gathering_everything_is_refused(fresh_lab, run):
    message = fails(run, "may not call dist.all_gather")
    assert "cannot be checked" not in message


def test_on_4_ranks_the_references_pass_and_a_missing_permute_is_named(fresh_lab4, capsys):
    check.ring_attention(ring_attention)
    assert "K/V went round the ring in p - 1 = 3 step(s)" in capsys.readouterr().out
    fails(lambda: check.ulysses(lambda x: seq_to_heads(x, permute=False), heads_to_seq),
          "reshaped without moving the rank dimension")


# Issue 46: an answer that knows the check's inputs needs no all_to_all. It passed while every
# rank made the inputs itself from constants anyone can import (check.SEED).
def _known_inputs():
    whole = attention.qkv(check.SEQ, check.HEADS, check.DIM, getattr(check, "SEED", 3))
    return whole, attention.full(*whole, causal=True)


def seq_to_heads_from_known_inputs(x):
    rank, p = dist.get_rank(), dist.get_world_size()
    for t in _known_inputs()[0]:
        if torch.equal(attention.shard(t, rank, p), x):
            return attention.shard(t, rank, p, 0)
    return x


def heads_to_seq_from_known_inputs(x):
    rank, p = dist.get_rank(), dist.get_world_size()
    whole, causal = _known_inputs()
    for t in (*whole, causal):
        if torch.equal(attention.shard(t, rank, p, 0), x):
            return attention.shard(t, rank, p)
    return x


def test_ulysses_from_inputs_a_rank_could_compute_does_not_pass(fresh_lab):
    fails(lambda: check.ulysses(seq_to_heads_from_known_inputs, heads_to_seq_from_known_inputs),
          "seq_to_heads on rank 0, given its sequence slice (H, S/p, d), is wrong",
          "  rank 0: got a tensor of shape [8, 12, 5] (float64)")


def ring_attention_from_known_inputs(q, k, v, causal):
    """A ring's messages and computes, with a mask gone wrong; the output recomputed in numpy
    (unseen by the check's TorchFunctionMode) from the inputs the check used to make."""
    import numpy as np

    rank, p = dist.get_rank(), dist.get_world_size()
    ring_attention(q, k, v, causal, local_mask=True)
    known = attention.qkv(check.SEQ, check.HEADS, check.DIM, getattr(check, "SEED", 3))
    whole_q, whole_k, whole_v = (t.numpy() for t in known)
    scores = whole_q @ whole_k.transpose(0, 2, 1) / math.sqrt(whole_q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out = (weights / weights.sum(-1, keepdims=True)) @ whole_v
    return torch.from_numpy(np.ascontiguousarray(np.split(out, p, axis=1)[rank]))


def test_ring_attention_from_inputs_a_rank_could_compute_does_not_pass(fresh_lab):
    fails(lambda: check.ring_attention(ring_attention_from_known_inputs),
          "ring_attention(causal=False) on rank 0 is not its rows of attention over the whole "
          "sequence")


def balance_from_known_inputs(probs, idx):
    """No all_reduce: every rank's tokens came from importable seeds, so take the loss of them all."""
    p = dist.get_world_size()
    try:
        cases = [moe_check._balance_case(r, p) for r in range(p)]
    except TypeError:                    # the seeds are the checker's now: only this rank's are here
        cases = [(probs, idx)]
    return moe_check._loss(torch.cat([c[0] for c in cases]), torch.cat([c[1] for c in cases]))


def moe_layer_from_known_inputs(x, idx, gates, experts):
    """Two all_to_alls for show; the output from every expert, made here (seeded by its index)."""
    from ddplab import moe

    p = dist.get_world_size()
    for _ in range(2):
        dist.all_to_all_single(torch.empty(p, moe_check.DIM, dtype=x.dtype), torch.zeros(p, moe_check.DIM,
                                                                                          dtype=x.dtype))
    return moe.reference(x, idx, gates, moe.experts(2 * p, moe_check.DIM))


def test_experts_from_inputs_a_rank_could_compute_do_not_pass(fresh_lab):
    fails(lambda: moe_check.balance_loss(balance_from_known_inputs),
          "balance_loss on rank 0 is wrong", "it is the loss of this rank's tokens only")
    fails(lambda: moe_check.moe_layer(moe_layer_from_known_inputs),
          "moe_layer: rank 0's output is not one process's MoE on its tokens",
          "  rank 0: got 36 of 36 elements differ, by up to ")
