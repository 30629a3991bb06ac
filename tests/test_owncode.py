"""Code that brings its own process group, on a lab's ranks: ``lab.spawn``, ``lab.run_script``.

Each program here is our own version of one learners bring, adapted only for
CPU: the PyTorch DDP tutorial's ``demo_basic`` and ``demo_checkpoint``,
pytorch/examples' ddp-tutorial-series torchrun script (``DistributedSampler``,
``set_epoch``, a snapshot it resumes from), and an FSDP2 ``fully_shard`` model
saved and loaded with ``torch.distributed.checkpoint``. Each asserts a real
result (weights against one process computing the same, a reloaded checkpoint
against the saved one), and that the lab's own group works afterwards.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from conftest import side_lab

from ddplab.errors import ConfigError, RankError

#: The tutorial's setup() names a fixed port; so does ours (one unlikely to be taken).
TUTORIAL_PORT = "29531"


def lab_world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


def assert_lab_usable(lab) -> None:
    assert lab.run(lab_world_size) == [2, 2]


# ------------------------------------------------------------------ the DDP tutorial
def setup(rank, world_size):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = TUTORIAL_PORT
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    import torch.distributed as dist
    dist.destroy_process_group()


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(10, 10)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def toy_batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)


def demo_basic(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    setup(rank, world_size)
    torch.manual_seed(0)                       # same initial weights everywhere (DDP checks)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    optimizer.zero_grad()
    inputs, labels = toy_batch(rank)
    loss_fn(ddp_model(inputs), labels).backward()
    optimizer.step()
    cleanup()
    return {k: v.clone() for k, v in model.state_dict().items()}


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


# ------------------------------------------------------------------ a torchrun script
SCRIPT = '''
"""Our version of pytorch/examples' ddp-tutorial-series multigpu_torchrun.py, on CPU."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset():
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))


class Trainer:
    def __init__(self, model, data, optimizer, snapshot_path):
        self.rank = int(os.environ["LOCAL_RANK"])
        self.model, self.data, self.optimizer = model, data, optimizer
        self.epochs_run, self.snapshot_path = 0, snapshot_path
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, weights_only=True)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}")
        self.model = DDP(self.model)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self.data.sampler.set_epoch(epoch)
            for source, targets in self.data:
                self.optimizer.zero_grad()
                torch.nn.functional.mse_loss(self.model(source), targets).backward()
                self.optimizer.step()
            if self.rank == 0:
                torch.save({"MODEL_STATE": self.model.module.state_dict(),
                            "EPOCHS_RUN": epoch + 1}, self.snapshot_path)
            print(f"[GPU{self.rank}] Epoch {epoch} done")


def main(total_epochs, snapshot_path):
    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = DataLoader(dataset(), batch_size=4, shuffle=False,
                      sampler=DistributedSampler(dataset()))
    global trainer
    trainer = Trainer(model, data, torch.optim.SGD(model.parameters(), lr=0.05), snapshot_path)
    trainer.train(total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    env_seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                           "TORCHELASTIC_RUN_ID")}
    main(int(sys.argv[1]), sys.argv[2])
'''


def torchrun_reference(epochs, world_size=2):
    """The same training in one process: each step, the mean loss over every rank's batch."""
    from torch.utils.data import DistributedSampler
    namespace: dict = {"__name__": "reference"}
    exec(SCRIPT, namespace)
    data = namespace["dataset"]()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    samplers = [DistributedSampler(data, num_replicas=world_size, rank=r) for r in range(world_size)]
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        orders = [list(s) for s in samplers]
        for step in range(0, len(orders[0]), 4):
            optimizer.zero_grad()
            loss = sum(torch.nn.functional.mse_loss(model(data[o[step:step + 4]][0]),
                                                    data[o[step:step + 4]][1])
                       for o in orders) / world_size
            loss.backward()
            optimizer.step()
    return model.state_dict()


def script_state():
    from ddplab.rank import engine
    ns = engine.namespace()
    return {"env": ns["env_seen"], "epochs_run": ns["trainer"].epochs_run,
            "weights": {k: v.clone() for k, v in ns["trainer"].model.module.state_dict().items()}}


@pytest.mark.slow
def test_torchrun_script_runs_unchanged_and_resumes_from_its_snapshot(fresh_lab, tmp_path, capsys):
    script = tmp_path / "multigpu_torchrun.py"
    script.write_text(SCRIPT)
    snapshot = str(tmp_path / "snapshot.pt")
    fresh_lab.run_script(str(script), 2, snapshot)
    first = capsys.readouterr().out
    assert "[GPU1] Epoch 1 done" in first and "Resuming" not in first
    fresh_lab.run_script(str(script), 3, snapshot)
    second = capsys.readouterr().out
    assert "Resuming training from snapshot at Epoch 2" in second
    assert "[GPU0] Epoch 2 done" in second and "Epoch 1 done" not in second
    states = fresh_lab.run(script_state)          # the script's globals stayed on the ranks
    assert [s["env"]["RANK"] for s in states] == ["0", "1"]
    assert states[0]["env"]["WORLD_SIZE"] == "2" and states[1]["env"]["LOCAL_RANK"] == "1"
    assert states[0]["env"]["TORCHELASTIC_RUN_ID"]
    reference = torchrun_reference(3)
    for state in states:
        assert state["epochs_run"] == 2
        for name, tensor in reference.items():
            torch.testing.assert_close(state["weights"][name], tensor)
    assert_lab_usable(fresh_lab)


def test_run_script_imports_the_scripts_own_modules_afresh_each_run(fresh_lab, tmp_path, capsys):
    """As a new torchrun process would: two scripts' sibling model.py never collide, and an edited
    module runs as edited (the rank outlives the scripts it runs)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.py").write_text(f"WHO = {name!r}\n")
        (tmp_path / name / "main.py").write_text(
            "import os\nimport model\nif os.environ['RANK'] == '0':\n    print('model is', model.WHO)\n")
    fresh_lab.run_script(str(tmp_path / "a" / "main.py"))
    fresh_lab.run_script(str(tmp_path / "b" / "main.py"))
    (tmp_path / "a" / "model.py").write_text("WHO = 'a, edited'\n")
    fresh_lab.run_script(str(tmp_path / "a" / "main.py"))
    seen = [line for line in capsys.readouterr().out.splitlines() if "model is" in line]
    assert seen == ["model is a", "model is b", "model is a, edited"], seen
    paths = fresh_lab.run(lambda: [p for p in __import__("sys").path if str(tmp_path) in p])
    assert paths == [[], []]                          # no script folder left on sys.path


def test_a_script_that_calls_sys_exit_shows_its_own_line_only(fresh_lab, tmp_path):
    script = tmp_path / "leaves.py"
    script.write_text("import sys\nprint('hi')\nsys.exit(3)\n")
    with pytest.raises(RankError) as info:
        fresh_lab.run_script(str(script), timeout=60)
    for rank, text in info.value.failures.items():
        assert text == (f'Traceback (most recent call last):\n  File "{script}", line 3, in '
                        f'<module>\n    sys.exit(3)\nRuntimeError: the script exited with code 3 '
                        f'(sys.exit) on rank {rank}'), text          # no ddplab frame, no chain


def test_run_script_of_a_missing_file_is_a_config_error(fresh_lab, tmp_path):
    with pytest.raises(ConfigError, match="found no file at"):
        fresh_lab.run_script(str(tmp_path / "nowhere.py"))


def test_a_script_that_never_forms_a_group_says_so(fresh_lab, tmp_path, capsys):
    script = tmp_path / "gpu_only.py"
    script.write_text(textwrap.dedent("""
        import torch
        if torch.cuda.is_available():
            import torch.distributed as dist
            dist.init_process_group("nccl")
        print("nothing to do")
    """))
    fresh_lab.run_script(str(script))
    out = capsys.readouterr().err
    assert "without forming a process group" in out and "torch.cuda.is_available()" in out
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


# ------------------------------------------------------------------ ddplab.launch
RESTARTED = '''
import os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} on rank {rank}")
if attempt == 0 and rank == 1:
    raise SystemExit("rank 1 fails on the first attempt")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(3, 1))
g = torch.Generator().manual_seed(rank)
model(torch.randn(5, 3, generator=g)).sum().backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
torch.save({"attempt": attempt, "state": model.module.state_dict()},
           os.path.join(sys.argv[1], f"rank{rank}.pt"))
dist.destroy_process_group()
# torch 2.13's gloo can abort at interpreter teardown after all the work (1 run in 4 of
# notebook 10's scripts, which leave the same way): the attempt is done, leave now.
sys.stdout.flush()
os._exit(0)
'''


@pytest.mark.slow
def test_torchrun_max_restarts_keeps_every_attempt_by_rank(tmp_path):
    from ddplab import launch
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    result = launch.torchrun(str(script), str(tmp_path), nproc_per_node=2, max_restarts=1,
                             timeout=240)
    assert result.ok and result.attempts == 2 and result.groups_formed == 4
    assert "--max-restarts=1" in result.commands[0]
    assert "[attempt 0]\nattempt 0 on rank 1" in result.rank_output[1]
    assert "rank 1 fails on the first attempt" in result.rank_output[1]
    assert "[attempt 1]\nattempt 1 on rank 1" in result.rank_output[1]
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [s["attempt"] for s in saved] == [1, 1]
    for name, tensor in saved[0]["state"].items():
        torch.testing.assert_close(saved[1]["state"][name], tensor)


def test_torchrun_options_are_checked(tmp_path):
    from ddplab import launch
    with pytest.raises(ConfigError, match=r"no option --max-restart\. Did you mean max_restarts"):
        launch.torchrun("x.py", max_restart=1)
    with pytest.raises(ConfigError, match="sets --log-dir itself"):
        launch.torchrun("x.py", log_dir="/tmp")
    # launch.spawn's (and mp.spawn's) name for it, not the nearest spelling (nnodes)
    with pytest.raises(ConfigError, match=r"no option --nprocs\. Did you mean nproc_per_node=N "
                                          r"\(processes on each node; launch.spawn calls it "
                                          r"nprocs\)\?") as info:
        launch.torchrun("x.py", nprocs=2)
    assert "nnodes" not in str(info.value)


SPAWN_OWN_ARGS = '''
import os, sys
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world_size, total_epochs, save_every):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    print(f"rank {rank} of {world_size}: epochs={total_epochs} save_every={save_every}")
    dist.destroy_process_group()


if __name__ == "__main__":
    total_epochs, save_every = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(main, args=(2, total_epochs, save_every), nprocs=2)
'''

GPU_ONLY = '''
import torch
import torch.distributed as dist
if torch.cuda.is_available():
    dist.init_process_group("nccl")
print("no GPU, nothing trained")
'''


@pytest.mark.slow
def test_launches_pass_own_arguments_and_say_when_no_group_formed(tmp_path):
    from ddplab import launch
    script = tmp_path / "multigpu.py"
    script.write_text(SPAWN_OWN_ARGS)
    spawned = launch.spawn(str(script), "50", "10", timeout=120)
    assert spawned.commands[0][-2:] == ["50", "10"] and spawned.groups_formed == 2
    assert "rank 1 of 2: epochs=50 save_every=10" in spawned.launcher_output
    gpu_only = tmp_path / "gpu_only.py"
    gpu_only.write_text(GPU_ONLY)
    result = launch.torchrun(str(gpu_only), nproc_per_node=2, timeout=120)
    assert result.groups_formed == 0
    assert "no process formed a process group" in repr(result)


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


@pytest.mark.slow
def test_spawn_and_run_script_on_bare_ranks(tmp_path, capsys):
    """start(init_method=None): no lab group to set aside, the same code runs all the same."""
    script = tmp_path / "multigpu_torchrun.py"
    script.write_text(SCRIPT)
    bare = side_lab(2, init_method=None)
    try:
        for _ in range(2):                    # the tutorial's fixed port, twice in one process
            states = bare.spawn(demo_basic, args=(2,))
            torch.testing.assert_close(states[0]["net1.weight"], states[1]["net1.weight"])
        capsys.readouterr()
        bare.run_script(str(script), 1, str(tmp_path / "snapshot.pt"))
        captured = capsys.readouterr()
        assert "[GPU1] Epoch 0 done" in captured.out
        assert "without forming a process group" not in captured.err
    finally:
        bare.stop()
