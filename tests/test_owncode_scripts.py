"""Scripts that bring their own process group: ``lab.run_script`` on a lab's ranks, and
``ddplab.launch``'s torchrun and spawn.

The script is our version of pytorch/examples' ddp-tutorial-series torchrun
script (``DistributedSampler``, ``set_epoch``, a snapshot it resumes from),
adapted only for CPU. Each test asserts a real result (weights against one
process computing the same), and that the lab's own group works afterwards.
Functions given to ``lab.spawn``: tests/test_owncode_spawn.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import side_lab
from owncodekit import assert_lab_usable, demo_basic

from ddplab.errors import ConfigError, RankError

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
