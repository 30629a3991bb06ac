"""ddplab.check._observe.wire on a real 2-rank gloo lab: one path to the backend per test.

Each test runs one way of issuing a collective or a p2p op inside ``wire.recording()``
on every rank, and asserts which layer saw it (the c10d dispatcher, the backend's
methods, torch's flight recorder), its family, size and peer. Where the old ways of
counting (patching ``dist.all_reduce`` as ``AllReduceLog`` did; ``_forbid.counting``,
the flight recorder alone) get a path wrong, the same test shows it.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow      # real labs, like the checkers' own tests


#: path -> (family, layer that records it, whether the flight recorder saw it too, whether
#: lab.trace() (ddplab.rank.trace: dist's wrappers, and the dispatcher at the Autograd key) does)
PATHS = {
    "alias bound before": ("all_reduce", "dispatcher", True, True),
    "ProcessGroup method": ("all_reduce", "dispatcher", True, True),
    "backend method": ("all_reduce", "backend", True, False),
    "backend method bound before": ("all_reduce", "flight", False, False),
    "functional collective": ("all_reduce", "dispatcher", True, False),
    "torch.ops._c10d_functional under inference_mode": ("all_reduce", "dispatcher", True, False),
    "torch.ops.c10d": ("all_reduce", "dispatcher", True, True),
    "reduce_scatter_tensor": ("reduce_scatter", "dispatcher", True, True),
}


def _one_path(path: str) -> dict:
    """On a rank: issue one all_reduce-like op by ``path`` inside a record; what was seen."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import all_reduce as bound_early  # bound before the check, as a student may

    from ddplab.check._forbid import counting
    from ddplab.check._observe import wire
    from ddplab.rank import trace

    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    backend_allreduce = backend.allreduce                     # bound before the check
    t = torch.ones(6, dtype=torch.float64)
    ways = {
        "alias bound before": lambda: bound_early(t),
        "ProcessGroup method": lambda: group.allreduce([t]).wait(),
        "backend method": lambda: backend.allreduce([t]).wait(),
        "backend method bound before": lambda: backend_allreduce([t]).wait(),
        "functional collective": lambda: funcol.wait_tensor(funcol.all_reduce(t, "sum", group)),
        "torch.ops._c10d_functional under inference_mode": lambda: _inference(t),
        "torch.ops.c10d": lambda: dist.Work.unbox(torch.ops.c10d.allreduce_(
            [t], group.boxed(), torch.classes.c10d.ReduceOp(), None, False)[1]).wait(),   # SUM
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.zeros(3, dtype=torch.float64), t),
    }
    old = _OldAllReduceLog()                       # the old way: dist.all_reduce patched
    trace.start()
    try:
        with wire.recording() as record, counting("all_reduce") as flight_count, old:
            record.mark("before")
            ways[path]()
            record.mark("after")
    finally:
        column = trace.stop()["events"]["op"]           # packed: {"all": op, "n": count} or a list
        traced = [column["all"]] * column["n"] if isinstance(column, dict) else column
    ops = record.between(record.first("before"), record.first("after"))
    return {"ops": [(op.family, op.layer, op.numel, list(op.flight)) for op in ops],
            "traced": [op for op in traced if op != "wait"],
            "old_log": old.calls, "flight_counted_all_reduce": flight_count[0],
            "flight": {k: len(v) if isinstance(v, list) else v for k, v in record.flight.items()}}


def _inference(t):
    import torch

    with torch.inference_mode():
        x = torch.ones_like(t)
        torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(
            x, "sum", torch.distributed.group.WORLD.group_name))


class _OldAllReduceLog:
    """How the checkers counted until now (``_steps64.AllReduceLog``): ``dist.all_reduce`` and
    ``distributed_c10d.all_reduce`` replaced by a counting wrapper for the block."""

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.calls, real = 0, dist.all_reduce
        self.real = real

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        dist.all_reduce = c10d.all_reduce = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        dist.all_reduce = c10d.all_reduce = self.real


@pytest.mark.parametrize("path", list(PATHS))
def test_each_path_to_the_backend_is_recorded_once_by_its_layer(fresh_lab, path):
    family, layer, confirmed, traced = PATHS[path]
    for rank, got in enumerate(fresh_lab.run(_one_path, path, timeout=60)):
        # what lab.trace() records of it: one op (named as dist names it), or nothing
        assert len(got["traced"]) == int(traced) and all(family in op for op in got["traced"]), (rank, got)
        assert len(got["ops"]) == 1, (rank, got)
        seen_family, seen_layer, numel, flight_names = got["ops"][0]
        assert (seen_family, seen_layer, numel) == (family, layer, 6), (rank, got)
        assert bool(flight_names) == confirmed, (rank, got)
        assert got["flight"]["unconfirmed"] == got["flight"]["disagree"] == 0, (rank, got)
        assert got["flight"]["unexplained"] == (layer == "flight"), (rank, got)
        if path != "reduce_scatter_tensor":
            assert got["old_log"] == 0, "the old log saw it after all: this path is no example"
    if path == "reduce_scatter_tensor":
        # gloo carries out a reduce_scatter as an all_reduce: the flight recorder alone
        # (_forbid.counting) counts it as one, the record names it for what was called
        assert got["flight_counted_all_reduce"] == 1 and flight_names == ["all_reduce"]


def _p2p_ring(hops: int) -> dict:
    """On a rank: a ring of batch_isend_irecv (send to the next, receive from the previous),
    then a send on the backend directly; what the record and the flight recorder saw."""
    import torch
    import torch.distributed as dist

    from ddplab.check._forbid import counting
    from ddplab.check._observe import wire

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    with wire.recording() as record, counting("all_reduce"):
        for hop in range(hops):
            out, into = torch.full((hop + 1,), float(rank)), torch.zeros(hop + 1)
            ops = [dist.P2POp(dist.isend, out, right), dist.P2POp(dist.irecv, into, left)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            assert into[0].item() == left
        record.mark("backend")
        if rank % 2 == 0 and right != rank:
            backend.send([torch.ones(2)], right, 7).wait()
        elif rank % 2 == 1:
            backend.recv([torch.zeros(2)], left, 7).wait()
    from ddplab.rank import flight
    return {"ops": [(op.family, op.layer, op.peer, op.numel, op.done is not None) for op in record.ops],
            "flight_p2p": [e for e in (flight.entries_after(-1) or []) if e.get("is_p2p")]}


def test_batch_isend_irecv_and_a_backend_send_are_recorded_with_peers_in_order(fresh_lab):
    for rank, got in enumerate(fresh_lab.run(_p2p_ring, 2, timeout=60)):
        other = 1 - rank
        assert got["ops"][:4] == [(family, "dispatcher", other, n, True)
                                  for n in (1, 2) for family in ("send", "recv")], got
        direct = "send" if rank == 0 else "recv"
        assert got["ops"][4:] == [(direct, "backend", other, 2, True)], got
        assert got["flight_p2p"] == []       # gloo's flight recorder keeps no p2p at all


@pytest.mark.slow
def test_a_ring_on_four_ranks_keeps_each_ranks_peers_in_order():
    import ddplab

    with ddplab.start(world_size=4, backend="gloo", timeout=60) as lab:
        got = lab.run(_p2p_ring, 3, timeout=120)
    for rank, seen in enumerate(got):
        right, left = (rank + 1) % 4, (rank - 1) % 4
        ring = [(family, peer, numel) for family, layer, peer, numel, _ in seen["ops"][:6]]
        assert ring == [("send", right, 1), ("recv", left, 1), ("send", right, 2), ("recv", left, 2),
                        ("send", right, 3), ("recv", left, 3)], (rank, ring)
        direct = ("send", "backend", right) if rank % 2 == 0 else ("recv", "backend", left)
        assert seen["ops"][6][:3] == direct, (rank, seen["ops"])


def _hostile() -> dict:
    """On a rank: a submission that renames dist.all_reduce to a no-op, all_reduces through its
    group anyway, then walks the interpreter to the record and deletes what it did."""
    import gc

    import torch
    import torch.distributed as dist

    from ddplab.check._observe import record as record_module, wire

    real, rank = dist.all_reduce, dist.get_rank()
    with wire.recording() as record:
        held_by_modules = [name for module in (wire, record_module) for name, value in vars(module).items()
                           if value is record]
        dist.all_reduce = lambda *args, **kwargs: None          # renaming hides nothing
        dist.group.WORLD.allreduce([torch.ones(3)]).wait()
        dist.all_reduce = real
        dist.send(torch.ones(2), 1 - rank) if rank == 0 else dist.recv(torch.zeros(2), 0)
        before = [(op.family, op.layer) for op in record.ops]
        for obj in gc.get_objects():                             # what a hostile rank can do
            if type(obj).__name__ == "Record" and hasattr(obj, "events"):
                obj.events.clear()
    return {"held_by_modules": held_by_modules, "before": before,
            "after": [(op.family, op.layer) for op in record.ops],
            "unexplained": len(record.flight["unexplained"])}


def test_a_hostile_rank_can_delete_a_send_but_not_a_collective(fresh_lab):
    for rank, got in enumerate(fresh_lab.run(_hostile, timeout=60)):
        assert got["held_by_modules"] == []              # no importable name holds the record
        p2p = "send" if rank == 0 else "recv"
        assert got["before"] == [("all_reduce", "dispatcher"), (p2p, "dispatcher")], got
        # the collective comes back from the flight recorder, which Python cannot edit;
        # the send is gone: gloo's recorder keeps no p2p, so nothing witnesses it
        assert got["after"] == [("all_reduce", "flight")] and got["unexplained"] == 1, got
