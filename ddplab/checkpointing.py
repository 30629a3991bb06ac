"""Notebook 10's helpers on the ranks: the FSDP2 model it checkpoints, and what a checkpoint holds.

    from ddplab.checkpointing import fsdp_mlp, tensor_bytes
    model = fsdp_mlp(seed=0)            # notebook 08's MLP (float64), every Linear and the root sharded
    tensor_bytes(path)                  # {file: bytes of tensor data} of a torch.distributed.checkpoint

Every rank calls ``fsdp_mlp`` (``fully_shard`` is collective in spirit: every
rank must shard the same model the same way). ``tensor_bytes`` reads only the
checkpoint's ``.metadata``: the one file that says which piece of which tensor
lies in which ``.distcp`` file, at what offset.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fsdp_mlp", "tensor_bytes"]


def fsdp_mlp(seed: int = 0, dtype: Any = None) -> Any:
    """Notebook 08's MLP (float64 unless ``dtype``) under ``fully_shard``: every Linear, then the root.

    Called on every rank of the default process group; each rank then holds
    ``1/world_size`` of the rows of every parameter (``Shard(0)`` DTensors).
    """
    import warnings

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .sharding import mlp

    # FSDP2 warns once per process that a wrapped module's forward is called directly: not here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = mlp(seed=seed, dtype=dtype if dtype is not None else torch.float64)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tensor_bytes(path: str) -> dict[str, int]:
    """Bytes of tensor data in each file of the checkpoint in ``path``, read from its ``.metadata``.

    For each tensor (by its name in the saved dict) the metadata lists its
    chunks (offsets and sizes) and, per chunk, the file that holds it; plain
    values (an epoch number) have no chunks and are left out.
    """
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata()
    out: dict[str, int] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        for chunk in getattr(meta, "chunks", []):
            index = dcp.metadata.MetadataIndex(fqn, chunk.offsets)
            name = metadata.storage_data[index].relative_path
            out[name] = out.get(name, 0) + chunk.sizes.numel() * meta.properties.dtype.itemsize
    return dict(sorted(out.items()))
