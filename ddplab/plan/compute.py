"""Step 2 of a plan: how long a rank computes per step, from FLOPs and a device's peak.

    seconds = flops / (peak(device, dtype) * efficiency)

The FLOPs are counted, not guessed: ``ddplab.plan.flops`` runs the step under
``torch.utils.flop_counter.FlopCounterMode`` (matmuls, attention, convolutions:
2 FLOPs per multiply-add, the backward and checkpointing's recomputation included). The peak comes from
torch's own table of datasheet numbers where it has the device
(``torch._inductor.analysis.device_info``, dense: sparsity factor removed),
else from the small table below. ``efficiency`` is the share of the peak a
real training step reaches (MFU): 0.4 is typical of a well-tuned LLM on
H100s; say what you assume. ``"this-cpu"`` is measured: the matmul FLOP/s of
one process here, shared by the ranks that share this machine's cores; there
gloo's collectives run on the same cores, so none of them hides behind compute.

Not modelled: kernels one by one (their launch overhead, memory-bound ops
such as norms and the optimizer step), which efficiency lumps together.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DEVICES", "Device", "device", "measured_cpu"]

# Dense TFLOP/s (bf16 tensor cores; fp32 without TF32) where torch's table lacks them.
DEVICES: dict[str, dict[str, float]] = {
    "h100": {"torch_name": "NVIDIA H100", "bfloat16": 989.0, "float32": 67.0, "memory_gb": 80},
    "a100": {"torch_name": "NVIDIA A100", "bfloat16": 312.0, "float32": 19.5, "memory_gb": 80},
    "h200": {"torch_name": "", "bfloat16": 989.0, "float32": 67.0, "memory_gb": 141},
    "mi300x": {"torch_name": "AMD MI300X", "bfloat16": 1307.4, "float32": 163.4, "memory_gb": 192},
}


@dataclass(frozen=True)
class Device:
    name: str
    flops: dict[str, float]        # dtype -> FLOP/s at peak
    memory: float                  # bytes a rank may use
    source: str                    # where the numbers come from
    efficiency: float = 0.4
    overlap: bool = True           # can communication run beside compute? Not on CPUs that
                                   # gloo's threads share with the ranks' compute

    def seconds(self, flops: float, dtype: str) -> float:
        peak = self.flops.get(dtype) or self.flops.get("float32")
        return flops / (peak * self.efficiency)


def device(name: str, efficiency: float = 0.4, memory_gb: float | None = None,
           ranks_here: int = 1) -> Device:
    """A named device: torch's datasheet numbers where it has them, else ``DEVICES``."""
    if name == "this-cpu":
        return measured_cpu(ranks_here, memory_gb or 4.0, efficiency)
    if name not in DEVICES:
        raise ConfigError(f"ddplab.plan: no device named {name!r}; use one of "
                          f"{', '.join([*DEVICES, 'this-cpu'])}.")
    row = DEVICES[name]
    flops = {k: v * 1e12 for k, v in row.items() if k in ("bfloat16", "float32")}
    source = "ddplab.plan.compute.DEVICES (datasheet, dense)"
    try:
        import torch
        from torch._inductor.analysis.device_info import lookup_device_info
        info = lookup_device_info(row["torch_name"]) if row["torch_name"] else None
        if info is not None:
            dense = {str(k).removeprefix("torch."): v / info.tops_sparsity_factor
                     for k, v in info.tops.items() if k in (torch.bfloat16, torch.float32)}
            flops.update({k: v * 1e12 for k, v in dense.items()})
            source = "torch._inductor.analysis.device_info (datasheet, sparsity removed)"
    except ImportError:
        pass
    return Device(name, flops, (memory_gb or row["memory_gb"]) * 1e9, source, efficiency)


def measured_cpu(ranks_here: int = 1, memory_gb: float = 4.0, efficiency: float = 1.0) -> Device:
    """This machine, measured: a 512x512 fp32 matmul's FLOP/s in this process (the best of 20:
    on a shared machine the others measure the neighbours), times the cores a rank gets when
    ``ranks_here`` ranks share them (each rank one thread at most)."""
    import torch

    n, a = 512, torch.randn(512, 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ a
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    share = min(1.0, (os.cpu_count() or 1) / max(1, ranks_here))
    rate = 2 * n**3 / best * share
    return Device("this-cpu", {"float32": rate, "bfloat16": rate}, memory_gb * 1e9,
                  f"measured here: one thread's matmul, x{share:g} for {ranks_here} ranks on "
                  f"{os.cpu_count()} cores", efficiency, overlap=False)
