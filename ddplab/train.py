"""One DistributedDataParallel training function, three ways to launch it.

``train()`` trains a small CNN on the handwritten digits (``ddplab.data``)
with DDP and returns what it learned. It reads everything it needs from the
process group, or from the environment variables torchrun sets, so the same
function runs

- on a ddplab lab, from a notebook:   ``lab.run(ddplab.train.train, epochs=6)``
- through ``torch.multiprocessing.spawn``::

      python -m ddplab.train --nodes 1 --node-rank 0 --procs-per-node 2

- through torchrun, which starts the processes and sets RANK, WORLD_SIZE, ...::

      torchrun --nnodes 1 --nproc-per-node 2 -m ddplab.train

Placement (``placement``), the rule ``ddplab.start(backend="auto")`` follows too
(``ddplab.env.nccl_fits``):
at least one GPU per local rank -> nccl, one GPU each; fewer GPUs than local
ranks -> gloo, ranks share the GPUs (nccl refuses two ranks on one GPU);
no GPU -> gloo on CPU.

With the same seed and the same number of threads per process, the three
launchers end with bit-identical weights: the data split, the model's
initial weights and the sampler's shuffles all come from the seed, and DDP
averages the same gradients in the same order.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from . import data, progress
from .env import nccl_fits
from .errors import CommandError, ConfigError
from .text import plural


@dataclass
class Config:
    """What to train, and how. Every rank must be given the same config."""
    epochs: int = 8
    batch_size: int = 32          # per rank: one step sees batch_size * world_size samples
    lr: float = 5e-3              # Adam
    seed: int = 0
    checkpoint: str = ""          # a path: rank 0 saves the trained model there at the end
    verbose: bool = True          # rank 0 prints one line per epoch


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers: 38,282 weights.

    8x8 digits: (1, 8, 8) -> conv (16, 8, 8) -> conv (32, 8, 8) -> pool (32, 4, 4)
    -> linear 64 -> linear 10 class scores.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def placement(local_world_size: int, local_rank: int, gpus: int) -> tuple[str, torch.device, str]:
    """``(backend, device, why)`` for one rank, from how many GPUs this machine has.

    >>> placement(2, 1, gpus=0)[:2]
    ('gloo', device(type='cpu'))
    >>> placement(4, 3, gpus=2)[:2]
    ('gloo', device(type='cuda', index=1))
    """
    if nccl_fits(local_world_size, gpus):
        return "nccl", torch.device("cuda", local_rank), \
            f"nccl, one GPU per rank ({gpus} GPUs for {local_world_size} ranks)"
    if gpus > 0:
        return "gloo", torch.device("cuda", local_rank % gpus), \
            (f"gloo, ranks share {gpus} {plural(gpus, 'GPU')} among {local_world_size} "
             f"ranks (nccl refuses two ranks on one GPU)")
    return "gloo", torch.device("cpu"), "gloo on CPU (no GPU)"


def device_for_this_rank() -> torch.device:
    """The device of this rank in the running group: its own GPU under nccl, else shared/CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank)
    return placement(local_world, local_rank, torch.cuda.device_count())[1]


def wrap(model: nn.Module, device: torch.device) -> DDP:
    """DDP around ``model``: ``device_ids=[its GPU]`` on a GPU, nothing on CPU.

    Constructing DDP broadcasts rank 0's parameters and buffers to every rank,
    so all ranks start from the same weights whatever their own seed was.
    """
    model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def shard_loader(dataset, batch_size: int, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A DataLoader that gives this rank its own 1/world_size of ``dataset``.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch: the shuffle is
    drawn from ``seed + epoch``, identically on every rank, so the shards stay
    disjoint and the order still changes from epoch to epoch.
    """
    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def evaluate(model: nn.Module, dataset, device: torch.device,
             batch_size: int = 256) -> tuple[float, float]:
    """``(mean loss, accuracy)`` over the whole ``dataset``, the same on every rank.

    Each rank scores every world_size-th sample (no padding, so no sample
    counts twice), then one all_reduce sums loss, hits and counts over ranks.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = Subset(dataset, range(rank, len(dataset), world))
    totals = torch.zeros(3, dtype=torch.float64, device=device)   # loss sum, correct, count
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(mine, batch_size=batch_size):
            x, y = x.to(device), y.to(device)
            scores = model(x)
            totals[0] += F.cross_entropy(scores, y, reduction="sum").double()
            totals[1] += (scores.argmax(1) == y).sum()
            totals[2] += len(y)
    model.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def save_checkpoint(path: str, model: nn.Module, optimizer, epoch: int) -> None:
    """Rank 0 writes the checkpoint; every rank waits until it is complete.

    Only rank 0 writes, since every rank holds the same weights. The file is
    written beside ``path`` and renamed, so no rank can read half a file.
    """
    if dist.get_rank() == 0:
        module = model.module if isinstance(model, DDP) else model
        state = {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        partial = f"{path}.partial"
        torch.save(state, partial)
        os.replace(partial, path)
    dist.barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer=None,
                    device: torch.device | str = "cpu") -> int:
    """Every rank loads the checkpoint onto its own device; returns its epoch."""
    state = torch.load(path, map_location=device)
    (model.module if isinstance(model, DDP) else model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state["epoch"]


def train(config: Config | None = None, **changes: Any) -> dict:
    """Train SmallCNN on the digits with DDP on the running group; return the result.

    Joins a process group from torchrun's environment variables if none is
    running yet (and leaves it at the end). Returns a dict: ``rank``,
    ``world_size``, ``backend``, ``device``; ``history`` (per epoch: loss,
    accuracy, test_loss, test_accuracy, all_reduced over ranks, so the same
    on every rank), ``test_accuracy``, ``weights`` (a CPU state dict, the same
    on every rank), ``samples_per_s`` (all ranks together, training steps
    only, by this rank's clock) and the ``config``.
    """
    config = Config(**{**asdict(config or Config()), **changes})
    own_group = not dist.is_initialized()
    if own_group:
        init_from_env()
    try:
        result = _train(config)
        if own_group:
            # Free DDP (its reducer holds the group) and let every rank get
            # here before the group goes: a gloo group torn down while a peer
            # still uses it, or destroyed at interpreter exit, can abort.
            gc.collect()
            dist.barrier()
        return result
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(config: Config) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for_this_rank()
    log = print if config.verbose and rank == 0 else (lambda *args: None)
    train_set, test_set = data.digits(seed=config.seed)
    torch.manual_seed(config.seed)
    model = wrap(SmallCNN(), device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    loader = shard_loader(train_set, config.batch_size, seed=config.seed)
    total_steps, step = config.epochs * len(loader), 0
    history, seconds, samples = [], 0.0, 0
    for epoch in range(config.epochs):
        loader.sampler.set_epoch(epoch)    # a new shuffle each epoch, the same on every rank
        sums = torch.zeros(3, dtype=torch.float64, device=device)   # loss sum, correct, count
        started = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            scores = model(x)
            loss = F.cross_entropy(scores, y)
            loss.backward()                # DDP all_reduces (averages) the gradients here
            optimizer.step()
            sums += torch.stack([loss.detach().double() * len(y),
                                 (scores.argmax(1) == y).sum().double(),
                                 torch.tensor(len(y), dtype=torch.float64, device=device)])
            step += 1
            progress.report(step, total_steps, epoch=epoch + 1, loss=loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - started
        samples += int(sums[2].item()) * world
        dist.all_reduce(sums)
        test_loss, test_accuracy = evaluate(model, test_set, device)
        history.append({"epoch": epoch + 1, "loss": (sums[0] / sums[2]).item(),
                        "accuracy": (sums[1] / sums[2]).item(),
                        "test_loss": test_loss, "test_accuracy": test_accuracy})
        log(f"epoch {epoch + 1}/{config.epochs}: loss {history[-1]['loss']:.3f}, "
            f"test accuracy {test_accuracy:.1%}")
    if config.checkpoint:
        save_checkpoint(config.checkpoint, model, optimizer, config.epochs)
    weights = {name: tensor.detach().cpu().clone()
               for name, tensor in model.module.state_dict().items()}
    return {"rank": rank, "world_size": world, "backend": dist.get_backend(),
            "device": str(device), "history": history,
            "test_accuracy": history[-1]["test_accuracy"] if history else float("nan"),
            "weights": weights, "samples_per_s": samples / seconds if seconds else float("nan"),
            "config": asdict(config)}


def init_from_env() -> None:
    """``init_process_group`` from RANK, WORLD_SIZE, MASTER_ADDR/PORT, as torchrun sets them."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    backend, device, _ = placement(local_world, local_rank, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)     # before the group touches CUDA
    dist.init_process_group(backend, init_method="env://")


# ------------------------------------------------------------------ launchers
def _spawned(local_rank: int, nodes: int, node_rank: int, procs_per_node: int,
             master_addr: str, master_port: int, config: Config, out: str) -> None:
    """One process of ``torch.multiprocessing.spawn``: set torchrun's env, then train."""
    from .env import omp_threads, worker_env

    rank = node_rank * procs_per_node + local_rank
    os.environ.update(worker_env(rank, nodes * procs_per_node, master_addr, master_port,
                                 local_rank=local_rank, local_world_size=procs_per_node,
                                 node_rank=node_rank, nnodes=nodes))
    if "OMP_NUM_THREADS" not in os.environ:   # as the lab does: share the cores, do not fight
        torch.set_num_threads(omp_threads(procs_per_node))
    _run_and_save(config, out)


def _run_and_save(config: Config, out: str) -> dict:
    result = train(config)
    if out and result["rank"] == 0:
        torch.save(result, out)
    return result


def spawn(config: Config | None = None, nodes: int = 1, node_rank: int = 0,
          procs_per_node: int = 2, master_addr: str = "127.0.0.1",
          master_port: int | None = None, out: str = "") -> dict | None:
    """Train with ``torch.multiprocessing.spawn``: ``procs_per_node`` processes on this node.

    Returns rank 0's result when rank 0 runs on this node (node_rank 0), else None.
    With several nodes, run this on each with its ``node_rank`` and the same
    ``master_addr``/``master_port`` (rank 0's machine).
    """
    import torch.multiprocessing as mp

    from .env import free_port

    config = config or Config()
    if master_port is None:
        if nodes > 1:
            raise ConfigError("ddplab: with nodes > 1 every node must be given the same "
                             "master_port. Pass master_port=... (a free port on rank 0's machine).")
        master_port = free_port(master_addr)
    with tempfile.TemporaryDirectory(prefix="ddplab-train-") as tmp:
        path = out or os.path.join(tmp, "result.pt")
        mp.spawn(_spawned, nprocs=procs_per_node, join=True,
                 args=(nodes, node_rank, procs_per_node, master_addr, master_port, config, path))
        if node_rank == 0:
            return torch.load(path, weights_only=False)
    return None


def torchrun(config: Config | None = None, nproc_per_node: int = 2, nnodes: int = 1,
             timeout: float = 600, threads: int | None = None) -> dict:
    """Train under torchrun, in subprocesses on 127.0.0.1; return rank 0's result.

    Runs ``torchrun --nnodes N --node_rank i --nproc_per_node P -m ddplab.train``
    once per node (several nodes are simulated on this machine), on a free
    port, with the lab's thread count per process (or ``threads``), so the
    result can be compared with ``lab.run(train)``. It runs as every launch does
    (``ddplab.launch.job``): every process is ended even on failure, and a
    failure raises ``LaunchError`` with each rank's last lines.
    """
    from .env import free_port, omp_threads
    from .launch import job, torchrun_command

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddplab-torchrun-") as tmp:
        out = os.path.join(tmp, "result.pt")
        commands = [torchrun_command(["-m", "ddplab.train", *config_args(config), "--out", out],
                                     nnodes=nnodes, node_rank=node,
                                     nproc_per_node=nproc_per_node, master_port=port,
                                     log_dir=f"{{dir}}/logs-node{node}")
                    for node in range(nnodes)]
        threads = threads or omp_threads(nproc_per_node)
        job.run(commands, timeout, ports=[port], torchrun_nproc=nproc_per_node,
                env={"OMP_NUM_THREADS": str(threads)}, settle=0)
        return torch.load(out, weights_only=False)


def config_args(config: Config | None) -> list[str]:
    """``config`` as ``python -m ddplab.train`` options."""
    config = config or Config()
    return [word for f in fields(Config)
            for word in (f"--{f.name.replace('_', '-')}", str(int(getattr(config, f.name)) if
                         isinstance(f.default, bool) else getattr(config, f.name)))]


def run_commands(commands: list[list[str]], timeout: float, env: dict | None = None) -> list[str]:
    """Run commands side by side and return their output; end every process they started.

    A launched job (``ddplab.launch.job``, as ``ddplab.launch`` runs its own): raises
    ``CommandError`` (a ``LaunchError`` and a ``RuntimeError``) with the launch's report
    if one fails (at once: no settle time) or they make no progress for ``timeout`` s (no
    output, no CPU time used: a training that runs long is not stuck). Each command's
    session, and every descendant seen while waiting (torchrun's workers among them), is
    ended.
    """
    from .launch import failure, job

    result = job.run(commands, timeout, check=False, env=env, settle=0)
    if not result.ok:
        raise CommandError(failure.message(result, timeout), result)
    return result.outputs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddplab.train",
        description="Train a small CNN on the digits with DDP. Under torchrun (RANK and "
                    "WORLD_SIZE set) this process is one rank; otherwise it starts "
                    "--procs-per-node ranks with torch.multiprocessing.spawn.")
    parser.add_argument("-n", "--nodes", type=int, default=1, help="machines taking part")
    parser.add_argument("-nr", "--node-rank", type=int, default=0,
                        help="this machine's number, 0..nodes-1")
    parser.add_argument("-g", "--procs-per-node", type=int, default=2,
                        help="processes (ranks) per machine; GPUs per machine on GPU machines")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's machine")
    parser.add_argument("--master-port", type=int, default=None,
                        help="a free port there (default: a free one; needed with --nodes > 1)")
    for f in fields(Config):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default) if not
                            isinstance(f.default, bool) else int, default=f.default)
    parser.add_argument("--out", default="", help="rank 0 saves its result dict here (torch.save)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = Config(**{f.name: (bool(getattr(args, f.name)) if isinstance(f.default, bool)
                                else getattr(args, f.name)) for f in fields(Config)})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:     # torchrun started us
        _run_and_save(config, args.out)
    else:
        spawn(config, args.nodes, args.node_rank, args.procs_per_node, args.master_addr,
              args.master_port, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
