"""One training function, three launchers: the lab, torch.multiprocessing.spawn, torchrun.

All on CPU with 2 ranks and gloo, compared by final accuracy and weights.
GPU tests are marked and skip without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import torch

from ddplab import data, train
from ddplab.env import free_port

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------- data
def test_digits_split_is_fixed_and_stratified():
    train_set, test_set = data.digits()
    assert (len(train_set), len(test_set)) == (1437, 360)
    x, y = train_set[0]
    assert tuple(x.shape) == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0 <= float(train_set.tensors[0].min()) and float(train_set.tensors[0].max()) <= 1
    # Stratified: every digit holds about a fifth of its samples back for testing.
    counts = torch.bincount(test_set.tensors[1], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    again, _ = data.digits()
    assert torch.equal(again.tensors[0], train_set.tensors[0])
    assert data.digits(dtype=torch.float64)[0].tensors[0].dtype == torch.float64


def test_digits_rejects_a_bad_fraction():
    with pytest.raises(ValueError, match="test_fraction must be between 0 and 1"):
        data.digits(test_fraction=1.5)


# ------------------------------------------------------------------ placement
@pytest.mark.parametrize("ranks, gpus, backend, device", [
    (2, 0, "gloo", "cpu"),
    (2, 2, "nccl", "cuda:1"),
    (4, 8, "nccl", "cuda:1"),
    (4, 2, "gloo", "cuda:1"),     # ranks 1 and 3 share GPU 1
    (2, 1, "gloo", "cuda:0"),
])
def test_placement_matches_the_lab_rule(ranks, gpus, backend, device):
    got_backend, got_device, why = train.placement(ranks, 1, gpus)
    assert (got_backend, str(got_device)) == (backend, device)
    if backend == "gloo" and gpus:
        assert "nccl refuses two ranks on one GPU" in why


def test_config_round_trips_through_the_command_line():
    config = train.Config(epochs=3, batch_size=16, lr=0.01, seed=4, checkpoint="x.pt",
                          verbose=False)
    args = train._parser().parse_args(train.config_args(config) + ["-n", "2", "-nr", "1", "-g", "3"])
    assert (args.nodes, args.node_rank, args.procs_per_node) == (2, 1, 3)
    assert (args.epochs, args.batch_size, args.lr, args.seed, args.checkpoint, args.verbose) == \
        (3, 16, 0.01, 4, "x.pt", 0)


# ------------------------------------------------------------------ launchers
@pytest.fixture(scope="module")
def lab_result(lab):
    """The default training run through the 2-rank lab, from the notebook's point of view."""
    if not lab.healthy:
        lab.restart()
    return lab.run(train.train, verbose=False, timeout=300)


def same_weights(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_the_lab_trains_to_90_percent(lab_result):
    rank0, rank1 = lab_result
    assert (rank0["rank"], rank1["rank"], rank0["world_size"]) == (0, 1, 2)
    assert (rank0["backend"], rank0["device"]) == ("gloo", "cpu")
    assert rank0["test_accuracy"] >= 0.9
    assert rank0["history"] == rank1["history"], "metrics are all_reduced: equal on every rank"
    assert same_weights(rank0["weights"], rank1["weights"]) == 0
    assert len(rank0["history"]) == train.Config().epochs
    assert rank0["samples_per_s"] > 0


@pytest.mark.slow
def test_spawn_and_torchrun_end_with_the_labs_weights(lab_result, tmp_path):
    out = tmp_path / "spawn.pt"
    train.run_commands([[sys.executable, "-m", "ddplab.train", "--nodes", "1", "--node-rank", "0",
                         "--procs-per-node", "2", "--verbose", "0", "--out", str(out)]], timeout=300)
    spawned = torch.load(out, weights_only=False)
    torchrun = train.torchrun(train.Config(verbose=False), nproc_per_node=2, timeout=300)
    lab = lab_result[0]
    for name, result in [("spawn", spawned), ("torchrun", torchrun)]:
        assert result["world_size"] == 2, name
        assert result["test_accuracy"] == lab["test_accuracy"], name
        assert same_weights(result["weights"], lab["weights"]) <= 1e-6, name


@pytest.mark.slow
def test_two_nodes_of_one_process_each_match_one_node_of_two(lab_result, tmp_path):
    # The seed tutorial's arguments: nodes, node rank, processes per node.
    port = str(free_port())
    out = tmp_path / "two-nodes.pt"
    commands = [[sys.executable, "-m", "ddplab.train", "-n", "2", "-nr", str(node), "-g", "1",
                 "--master-port", port, "--verbose", "0", "--out", str(out)] for node in (0, 1)]
    train.run_commands(commands, timeout=300, env={"OMP_NUM_THREADS": "1"})
    result = torch.load(out, weights_only=False)
    assert result["world_size"] == 2
    assert same_weights(result["weights"], lab_result[0]["weights"]) <= 1e-6


@pytest.mark.slow
def test_rank_0_saves_a_checkpoint_every_rank_can_load(fresh_lab, tmp_path):
    path = str(tmp_path / "digits.pt")
    results = fresh_lab.run(train.train, epochs=1, checkpoint=path, verbose=False, timeout=300)

    def load_back(path):
        from ddplab.train import SmallCNN, load_checkpoint
        model = SmallCNN()
        epoch = load_checkpoint(path, model)
        return epoch, model.state_dict()

    for epoch, weights in fresh_lab.run(load_back, path):
        assert epoch == 1
        assert same_weights(weights, results[0]["weights"]) == 0
    assert os.listdir(tmp_path) == ["digits.pt"], "written whole, then renamed: no partial file left"


@pytest.mark.slow
def test_spawn_from_python_returns_rank_0s_result(fresh_lab):
    spawned = train.spawn(train.Config(epochs=1, verbose=False), procs_per_node=2)
    labbed = fresh_lab.run(train.train, epochs=1, verbose=False, timeout=300)[0]
    assert (spawned["rank"], spawned["world_size"]) == (0, 2)
    assert same_weights(spawned["weights"], labbed["weights"]) <= 1e-6


def test_nodes_above_one_need_a_port():
    with pytest.raises(ValueError, match="master_port"):
        train.spawn(train.Config(), nodes=2)


# ---------------------------------------------------------------- subprocesses
@pytest.mark.slow
def test_run_commands_ends_every_process_when_time_runs_out():
    child = ("import subprocess, sys, time\n"
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
             "print(p.pid, flush=True)\n"
             "time.sleep(120)\n")
    # Its start (output, CPU) is progress; then nothing for a whole timeout: it is ended.
    with pytest.raises(RuntimeError, match="the job made no progress for timeout=5 s") as info:
        train.run_commands([[sys.executable, "-c", child]], timeout=5)      # the child sleeps 120 s
    grandchild = int(str(info.value).split("---\n")[1].split()[0])
    assert not psutil.pid_exists(grandchild) or \
        psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_run_commands_lets_a_job_that_prints_run_past_its_timeout():
    child = "import time\nfor step in range(6):\n    print('step', step, flush=True)\n    time.sleep(1)\n"
    out = train.run_commands([[sys.executable, "-c", child]], timeout=3)    # 6 s of steps
    assert out[0].split() == ["step", "0", "step", "1", "step", "2", "step", "3", "step", "4",
                              "step", "5"]


@pytest.mark.slow
def test_run_commands_reports_a_failure_with_its_output():
    with pytest.raises(RuntimeError, match="the job failed") as info:
        train.run_commands([[sys.executable, "-c", "print('boom'); raise SystemExit(3)"]],
                           timeout=60)
    assert "boom" in str(info.value) and "exit 3" in str(info.value)


@pytest.mark.slow
def test_the_module_runs_as_a_program_and_explains_itself():
    out = subprocess.run([sys.executable, "-m", "ddplab.train", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for option in ("--nodes", "--node-rank", "--procs-per-node", "--epochs", "--out"):
        assert option in out.stdout


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@needs_cuda
def test_gpu_placement_follows_the_gpu_count():
    import ddplab
    gpus = torch.cuda.device_count()
    with ddplab.start(world_size=2, backend="auto") as lab:
        results = lab.run(train.train, epochs=2, verbose=False, timeout=300)
    expected_backend = "nccl" if gpus >= 2 else "gloo"
    for rank, result in enumerate(results):
        assert result["backend"] == expected_backend
        assert result["device"] == f"cuda:{rank % gpus}"
    assert same_weights(results[0]["weights"], results[1]["weights"]) == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_torchrun_trains_to_90_percent():
    result = train.torchrun(train.Config(verbose=False), nproc_per_node=2, timeout=300)
    assert result["device"].startswith("cuda")
    assert result["test_accuracy"] >= 0.9
