"""ddplab.check._observe.overlap and schedule.Watch.gradients on a real 2-rank gloo lab.

Five ways to all_reduce the gradients of the tiny float64 MLP of notebook 12, each
run under the record with the checker's own marks: real overlap (a hook that starts
an async all_reduce), the same through ``from torch.distributed import all_reduce``
bound before the check, a hook that waits for its own all_reduce, a hook on one
parameter with the rest all_reduced after backward, and reduce_scatter + all_gather
in place of all_reduce. The old way (``dist.all_reduce`` patched, its calls flagged
in or out of backward, judged as ``overlap_hooks`` judged them) is run beside it.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow      # real labs, like the checkers' own tests


def _install(variant: str, net, bound_early) -> list:
    """The student's side: hooks on the parameters, per ``variant``; returns the handles list.
    ``bound_early``: ``dist.all_reduce`` as a cell that ran before the check imported it."""
    import torch.distributed as dist

    world, handles = dist.get_world_size(), []
    params = list(net.parameters())

    def overlap(p):
        p.grad /= world
        handles.append(dist.all_reduce(p.grad, async_op=True))

    def aliased(p):
        p.grad /= world
        handles.append(bound_early(p.grad, async_op=True))

    def waits(p):
        p.grad /= world
        dist.all_reduce(p.grad, async_op=True).wait()          # "async", then waits at once

    hook = {"overlap": overlap, "alias": aliased, "waits in hook": waits, "one hook": overlap}
    if variant in hook:
        for p in params[-1:] if variant == "one hook" else params:
            p.register_post_accumulate_grad_hook(hook[variant])
    return handles


def _finish(variant: str, net, handles: list) -> None:
    """The student's side after backward: wait for the handles, or communicate now."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    params = list(net.parameters())
    for handle in handles:
        handle.wait()
    if variant == "one hook":
        for p in params[:-1]:
            p.grad /= world
            dist.all_reduce(p.grad)
    if variant == "rs+ag":
        flat = torch.cat([p.grad.reshape(-1) for p in params]) / world
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % world)])
        shard = flat.new_zeros(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, flat)
        dist.all_gather_into_tensor(flat, shard)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _train(variant: str, key: str, rows: tuple) -> dict:
    """On a rank: one step of ``variant`` under the record and the old log; both views."""
    import torch.nn.functional as F
    from torch.distributed import all_reduce as bound_early  # a cell before the check: the real one

    from ddplab.check._forbid import counting
    from ddplab.check._observe import overlap, schedule, wire
    from ddplab.sharding import tiny_mlp

    net = tiny_mlp()
    params = list(net.parameters())
    x, y = rows
    old = _OldLog()
    with wire.recording() as record, counting("all_reduce") as flight_all_reduces, old:
        handles = _install(variant, net, bound_early)
        schedule.Watch(record).gradients(params)             # after the student's hooks
        overlap.pace(params, key)                           # after the marks
        old.in_backward = True
        with overlap.backward(record, step=0):
            F.mse_loss(net(x), y).backward()
        old.in_backward = False
        _finish(variant, net, handles)
        record.mark("step", step=0)
    return {"facts": overlap.facts(record, step=0), "old": old.verdict(len(params)),
            "flight_all_reduces": flight_all_reduces[0],
            "grads": [p.grad.clone() for p in params]}


class _OldLog:
    """The old way (``_steps64.AllReduceLog`` and ``overlap_hooks``' rules): ``dist.all_reduce``
    patched; accepted when a call was async, one started inside backward, every handle was
    waited for, and there was one call per parameter."""

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.calls, self.in_backward, self.real = [], False, dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            self.calls.append({"async": kwargs.get("async_op", False), "in_backward": self.in_backward})
            return self.real(tensor, *args, **kwargs)

        dist.all_reduce = c10d.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        dist.all_reduce = c10d.all_reduce = self.real

    def verdict(self, params: int) -> str:
        if not self.calls:
            return "refused: no dist.all_reduce was called"
        if not any(c["async"] for c in self.calls):
            return "refused: every all_reduce blocking"
        if not any(c["in_backward"] for c in self.calls):
            return "refused: every all_reduce after backward"
        return "accepted" if len(self.calls) == params else "refused: calls per step"


def _rows(lab):
    import torch

    g = torch.Generator().manual_seed(54)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64)
    return {rank: ((x.chunk(2)[rank], y.chunk(2)[rank]),) for rank in range(lab.world_size)}


def _run(lab, variant: str) -> list[dict]:
    import secrets

    got = lab.run_each(_train, _rows(lab), variant, f"test-overlap-{secrets.token_hex(8)}", timeout=60)
    return [got[rank] for rank in sorted(got)]


def test_a_real_overlap_is_seen_on_rank_0(fresh_lab):
    facts = _run(fresh_lab, "overlap")[0]["facts"]
    assert sorted(facts["in_backward"]) == sorted([60, 10, 100, 10, 30, 3]), facts   # one per parameter
    assert facts["overlapped"] == 6 and facts["waited_inside"] == 0, facts
    assert facts["after_backward"] == [] and facts["pending_at_step"] == 0, facts


def test_the_old_log_refuses_a_correct_overlap_bound_early_and_the_record_sees_it(fresh_lab):
    got = _run(fresh_lab, "alias")
    assert got[0]["old"] == "refused: no dist.all_reduce was called"          # issue 54's false rejection
    assert got[0]["facts"]["overlapped"] == 6 and len(got[0]["facts"]["in_backward"]) == 6, got[0]["facts"]


def test_a_hook_that_waits_for_its_own_all_reduce_overlaps_nothing(fresh_lab):
    got = _run(fresh_lab, "waits in hook")
    assert got[0]["old"] == "accepted"                                       # the old way is fooled
    facts = got[0]["facts"]
    assert len(facts["in_backward"]) == 6 and facts["overlapped"] == 0 and facts["waited_inside"] == 6, facts


def test_a_hook_on_one_parameter_with_the_rest_after_backward_is_seen_as_such(fresh_lab):
    got = _run(fresh_lab, "one hook")
    assert got[0]["old"] == "accepted"                                       # any(in_backward) held
    facts = got[0]["facts"]
    assert len(facts["in_backward"]) == 1 and len(facts["after_backward"]) == 5, facts


def test_reduce_scatter_and_all_gather_in_place_of_all_reduce_are_named(fresh_lab):
    got = _run(fresh_lab, "rs+ag")
    facts = got[0]["facts"]
    assert facts["families"] == ["reduce_scatter", "all_gather"], facts
    assert got[0]["old"] == "refused: no dist.all_reduce was called"
    # gloo carries out the reduce_scatter as an all_reduce: the flight recorder alone counts one
    assert got[0]["flight_all_reduces"] == 1
    overlap = _run(fresh_lab, "overlap")
    assert set(overlap[0]["facts"]["families"]) == {"all_reduce"}
    import torch
    for a, b in zip(got[0]["grads"], overlap[0]["grads"]):   # the same averaged gradients either way
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
