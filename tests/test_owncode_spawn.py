"""Functions that bring their own process group, on a lab's ranks: ``lab.spawn``.

Each program here is our own version of one learners bring, adapted only for
CPU: the PyTorch DDP tutorial's ``demo_basic`` and ``demo_checkpoint``, and an
FSDP2 ``fully_shard`` model saved and loaded with ``torch.distributed.checkpoint``.
Each asserts a real result (weights against one process computing the same, a
reloaded checkpoint against the saved one), and that the lab's own group works
afterwards. Also: the guards around the lab's group, tracing such code, and
notebook 03's checker. Whole scripts (``lab.run_script``, ``ddplab.launch``):
tests/test_owncode_scripts.py.
"""

from __future__ import annotations

import pytest
import torch
from owncodekit import ToyModel, assert_lab_usable, cleanup, demo_basic, setup, toy_batch

from ddplab.errors import ConfigError, RankError


def one_process_reference(world_size):
    """What DDP computes: one step on the mean of every rank's loss."""
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = sum(torch.nn.functional.mse_loss(model(x), y)
               for x, y in map(toy_batch, range(world_size))) / world_size
    loss.backward()
    optimizer.step()
    return model.state_dict()


def demo_checkpoint(rank, world_size, path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    setup(rank, world_size)
    torch.manual_seed(rank)                   # different weights: DDP broadcasts rank 0's
    ddp_model = DDP(ToyModel())
    if rank == 0:
        torch.save(ddp_model.state_dict(), path)
    dist.barrier()                            # rank 1 loads only once rank 0 has saved
    saved = {k: v.clone() for k, v in ddp_model.state_dict().items()}
    ddp_model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    inputs, labels = toy_batch(rank)
    torch.nn.functional.mse_loss(ddp_model(inputs), labels).backward()
    optimizer.step()
    cleanup()
    return {"saved": saved, "loaded": torch.load(path, weights_only=True),
            "after": {k: v.clone() for k, v in ddp_model.state_dict().items()}}


@pytest.mark.slow
def test_demo_basic_runs_unchanged_and_matches_one_process(fresh_lab):
    states = fresh_lab.spawn(demo_basic, args=(2,), nprocs=2, join=True)
    reference = one_process_reference(2)
    for state in states:
        for name, tensor in reference.items():
            torch.testing.assert_close(state[name], tensor)
    assert_lab_usable(fresh_lab)


@pytest.mark.slow
def test_demo_checkpoint_reloads_what_rank_zero_saved(fresh_lab, tmp_path):
    path = str(tmp_path / "model.checkpoint")
    r0, r1 = fresh_lab.spawn(demo_checkpoint, args=(2, path))
    for name, tensor in r0["loaded"].items():
        torch.testing.assert_close(r0["saved"][name], tensor)   # what rank 0 saved
        torch.testing.assert_close(r1["saved"][name], tensor)   # DDP broadcast rank 0's
        torch.testing.assert_close(r0["after"][name], r1["after"][name])
    assert not torch.equal(r0["after"]["module.net1.weight"], r0["saved"]["module.net1.weight"])
    assert_lab_usable(fresh_lab)


def fail_after_setup(rank, world_size):
    setup(rank, world_size)
    if rank == 1:
        raise ValueError("rank 1 gives up before cleanup()")
    cleanup()
    return rank


def test_spawn_failure_names_the_rank_and_the_lab_group_comes_back(fresh_lab):
    with pytest.raises(RankError) as info:
        fresh_lab.spawn(fail_after_setup, args=(2,))
    assert list(info.value.failures) == [1]
    assert "rank 1 gives up before cleanup()" in str(info.value)
    assert "owngroup.py" not in info.value.failures[1]     # the student's frames only
    assert_lab_usable(fresh_lab)


def test_spawn_and_run_send_the_users_module_as_the_kernel_has_it_now(fresh_lab, tmp_path, monkeypatch):
    """Edited and reloaded in the kernel, a function from the user's own module runs as edited on
    the ranks (they imported the module once and would keep the old code)."""
    import importlib
    import sys

    (tmp_path / "mymod_owncode.py").write_text("def work(rank=0):\n    return 'first'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh_lab.run(lambda p: __import__("sys").path.insert(0, p), str(tmp_path))
    import mymod_owncode
    try:
        assert fresh_lab.spawn(mymod_owncode.work) == ["first", "first"]
        (tmp_path / "mymod_owncode.py").write_text("def work(rank=0):\n    return 'edited'\n")
        importlib.invalidate_caches()
        importlib.reload(mymod_owncode)
        assert fresh_lab.spawn(mymod_owncode.work) == ["edited", "edited"]
        assert fresh_lab.run(mymod_owncode.work) == ["edited", "edited"]
    finally:
        sys.modules.pop("mymod_owncode", None)
        fresh_lab.run(lambda p: __import__("sys").path.remove(p), str(tmp_path))


def test_spawn_arguments_are_checked_as_mp_spawn_would(fresh_lab):
    with pytest.raises(ConfigError, match=r"must be a tuple.*args=\(2,\)"):
        fresh_lab.spawn(demo_basic, args=2)
    with pytest.raises(ConfigError, match=r"nprocs=4.*world_size=2"):
        fresh_lab.spawn(demo_basic, args=(4,), nprocs=4)


# ------------------------------------------------------------------ the guards, results
def test_init_process_group_in_a_cell_fails_at_once_naming_the_ways(fresh_lab):
    with pytest.raises(RankError) as info:
        fresh_lab.run_cell("import os\nos.environ['MASTER_PORT'] = '29532'\n"
                           "dist.init_process_group('gloo')", timeout=20)
    message = str(info.value)
    for words in ("LabGroupError", "already in the lab's process group", "lab.spawn(",
                  "lab.run_script(", "init_method=None"):
        assert words in message
    assert_lab_usable(fresh_lab)


def test_destroying_the_lab_group_says_how_to_get_it_back(fresh_lab, capsys):
    fresh_lab.run_cell("dist.destroy_process_group()")
    assert "lab.restart()" not in capsys.readouterr().err   # a notebook's clean-up stays quiet
    with pytest.raises(RankError) as info:
        fresh_lab.run_cell("t = torch.ones(1)\ndist.all_reduce(t)")
    for rank in (0, 1):
        text = info.value.failures[rank]
        assert "Default process group has not been initialized" in text
        assert f"destroy_process_group() removed the lab's process group on rank {rank}" in text
        assert "lab.restart()" in text
    fresh_lab.restart()
    assert_lab_usable(fresh_lab)


def lock_on_rank_one():
    import threading

    import torch.distributed as dist
    return threading.Lock() if dist.get_rank() == 1 else "fine"


def test_unpicklable_result_names_the_rank_and_the_type(fresh_lab):
    with pytest.raises(RankError) as info:
        fresh_lab.run(lock_on_rank_one)
    assert list(info.value.failures) == [1]
    text = info.value.failures[1]
    assert "returned a _thread.lock" in text and "cannot be sent back" in text
    assert "state_dict()" in text
    assert_lab_usable(fresh_lab)


# ------------------------------------------------------------------ FSDP2 and DCP
def fsdp_checkpoint(rank, world_size, folder):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    setup(rank, world_size)

    def sharded_model(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    model = sharded_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
    optimizer.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
    saved = {k: v.full_tensor() for k, v in model.state_dict().items()}
    fresh = sharded_model(1)                  # other weights, until loaded
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    fresh.load_state_dict(state["model"])
    loaded = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    shard_rows = model[0].weight.to_local().shape[0]
    dist.destroy_process_group()
    return {"saved": saved, "loaded": loaded, "shard_rows": shard_rows}


@pytest.mark.slow
def test_fsdp2_model_saved_and_loaded_with_dcp(fresh_lab, tmp_path):
    r0, r1 = fresh_lab.spawn(fsdp_checkpoint, args=(2, str(tmp_path / "dcp")))
    assert r0["shard_rows"] == r1["shard_rows"] == 8      # each rank held half of 16 rows
    for name, tensor in r0["saved"].items():
        torch.testing.assert_close(r0["loaded"][name], tensor)
        torch.testing.assert_close(r1["loaded"][name], tensor)
        torch.testing.assert_close(r1["saved"][name], tensor)
    assert_lab_usable(fresh_lab)


# ------------------------------------------------------------------ tracing such code
DDP_ON_ITS_OWN_GROUP = """
from torch.nn.parallel import DistributedDataParallel as DDP
g = dist.new_group([0, 1])
m = DDP(torch.nn.Linear(4, 2), process_group=g)
m(torch.randn(3, 4)).sum().backward()
dist.destroy_process_group(g)
"""


def test_trace_of_ddp_on_a_group_it_then_destroys(fresh_lab):
    """Was a KeyError in rank/recorder.py: the group was gone when the trace looked it up."""
    with fresh_lab.trace() as tr:
        fresh_lab.run_cell(DDP_ON_ITS_OWN_GROUP)
    bucket = [e for e in tr.events if e.source == "torch" and e.op == "all_reduce"]
    assert sorted(e.rank for e in bucket) == [0, 1]
    assert all(e.group == (0, 1) for e in bucket)
    assert {e.op for e in tr.events} >= {"new_group", "destroy_process_group", "broadcast"}
    assert_lab_usable(fresh_lab)


@pytest.mark.slow
def test_trace_of_spawned_code_with_its_own_group(fresh_lab):
    with fresh_lab.trace() as tr:
        states = fresh_lab.spawn(demo_basic, args=(2,))
    ops = [(e.rank, e.op) for e in tr.events]
    for rank in (0, 1):
        assert (rank, "init_process_group") in ops and (rank, "destroy_process_group") in ops
        assert (rank, "all_reduce") in ops                  # DDP's gradient bucket
    torch.testing.assert_close(states[0]["net1.weight"], states[1]["net1.weight"])
    assert_lab_usable(fresh_lab)


# ------------------------------------------------------------------ notebook 03's checker
def all_reduce_demo(rank, world_size):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def no_group_of_its_own(rank, world_size):
    return float(rank + 1)                    # no group, no all_reduce: each rank's own value


@pytest.mark.exercise("own_group_demo", "mistake", "no group of its own")
def test_own_group_demo_checker(fresh_lab, capsys):
    import ddplab
    ddplab.check.own_group_demo(all_reduce_demo, fresh_lab)
    assert capsys.readouterr().out.startswith("Correct: lab.spawn ran your function on 2 ranks")
    with pytest.raises(AssertionError, match="what fn\\(rank, world_size\\) returned"):
        ddplab.check.own_group_demo(no_group_of_its_own, fresh_lab)
    assert_lab_usable(fresh_lab)
