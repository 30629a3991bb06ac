"""The PyTorch DDP tutorial's ``demo_basic`` as learners bring it (ours, on CPU), and the check
that the lab's own group works afterwards: what tests/test_owncode_*.py share.

These functions run on the ranks, where they travel by value, as a test module's do
(tests/conftest.py), not by name.
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


#: The tutorial's setup() names a fixed port; so does ours (one unlikely to be taken).
TUTORIAL_PORT = "29531"


def lab_world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


def assert_lab_usable(lab) -> None:
    assert lab.run(lab_world_size) == [2, 2]


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
