"""Our own small program in the pattern of pytorch/examples' ``distributed/rpc/ddp_rpc`` (CPU, gloo).

Four processes, as ``torch.multiprocessing.spawn`` would start them: rank 2 is
the master, rank 3 a parameter server holding an embedding table (a
``RemoteModule``), ranks 0 and 1 trainers that form a DDP group of their own
(``init_process_group`` with ``world_size=2``) for the dense layer. The master
starts the training on each trainer with ``rpc.rpc_async(..., _run_trainer,
...)``, which pickles ``_run_trainer`` *by reference*: it works only where
``sys.modules[__name__]._run_trainer`` is the very function passed, as in a
process of its own (issue 63). Distributed autograd carries the gradients
back to the parameter server; ``DistributedOptimizer`` steps both parts.

Unlike the example, the data is drawn from fixed seeds and the master returns
what the test checks: each trainer's losses and dense weights, and the
embedding table before and after.
"""

from __future__ import annotations

import sys

import torch

NUM_EMBEDDINGS, EMBEDDING_DIM, CLASSES, STEPS = 20, 4, 3, 4
MASTER, PS, TRAINERS = 2, 3, (0, 1)


class HybridModel(torch.nn.Module):
    """A sparse part on the parameter server (``RemoteModule``), a dense part replicated by DDP."""

    def __init__(self, remote_emb_module):
        from torch.nn.parallel import DistributedDataParallel as DDP
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, CLASSES))

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def batch(trainer: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four bags of three indices each, and their classes: the same on every run."""
    g = torch.Generator().manual_seed(100 * trainer + step)
    indices = torch.randint(0, NUM_EMBEDDINGS, (12,), generator=g)
    return indices, torch.tensor([0, 3, 6, 9]), torch.randint(0, CLASSES, (4,), generator=g)


def _run_trainer(remote_emb_module, trainer: int) -> dict:
    """On a trainer, called by the master over RPC: ``STEPS`` steps of distributed training."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef

    model = HybridModel(remote_emb_module)
    params = model.remote_emb_module.remote_parameters()
    params += [RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    losses = []
    for step in range(STEPS):
        indices, offsets, target = batch(trainer, step)
        with dist_autograd.context() as context_id:
            loss = torch.nn.functional.cross_entropy(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
    return {"losses": losses, "fc": {k: v.clone() for k, v in model.fc.module.state_dict().items()},
            "same_object": sys.modules[__name__]._run_trainer is _run_trainer}


def run_worker(rank: int, world_size: int) -> dict | None:
    """What ``mp.spawn(run_worker, args=(4,), nprocs=4)`` runs in each process; the master's report."""
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule

    options = rpc.TensorPipeRpcBackendOptions(init_method="tcp://localhost:29501")
    report = None
    if rank == MASTER:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        remote_emb_module = RemoteModule("ps", torch.nn.EmbeddingBag,
                                         args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
        table = remote_emb_module.remote_parameters()[0]
        before = table.to_here().clone()
        futs = [rpc.rpc_async(f"trainer{t}", _run_trainer, args=(remote_emb_module, t))
                for t in TRAINERS]
        report = {"trainers": [fut.wait() for fut in futs], "before": before,
                  "after": table.to_here().clone()}
    elif rank in TRAINERS:
        dist.init_process_group("gloo", rank=rank, world_size=len(TRAINERS),
                                init_method="tcp://localhost:29500")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()
    return report
