"""Published training runs the planner is compared with (benchmarks/bench_plan.py, docs/plan.md).

    for run in RUNS: run.source, run.config, run.strategy, run.world_size, run.memory, run.tokens

Each run as its authors published it: the model, batch, precision and checkpointing
they trained with, the strategy and number of GPUs, and the numbers they measured
(memory per GPU, tokens per second per GPU). ``cannot`` says what in the run the
planner cannot express (Float8, torch.compile, async TP); empty if nothing. The
planner never reads these numbers: they are what its predictions are held against.

Sources:

- ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC'20 (arXiv:1910.02054), Table 1: the model states of a 7.5B
  model per device (GB) under mixed-precision Adam (2Ψ + 2Ψ + 12Ψ bytes), for data
  parallelism and its three stages (Pos, Pos+g, Pos+g+p) on N_d = 1 to 1,024 devices;
- torchtitan: ``benchmarks/llama3_h100_202412_torchtitan.md`` (github.com/pytorch/torchtitan,
  Dec 2024; torch 1963fc8): Llama 3.1 on H100s (96 GB HBM2e, 500 W), memory as the CUDA
  allocator's *reserved* peak in GiB, tokens/s per GPU at step 90;
- torchtitan async TP: ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025,
  the same machines): the "vanilla TP, bfloat16" rows (tokens/s per GPU, no memory).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from .models import CONFIGS, Config

__all__ = ["CALIBRATION", "RUNS", "Run", "ZERO_7B5", "compare", "markdown"]

TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
ZERO = "ZeRO (Rajbhandari et al., SC'20), Table 1"

# A 7.5B GPT: Megatron-LM's 7.5B shape (36 layers of 4,096) with a 32,000-token vocabulary and an
# untied head: 7.51B parameters, trained in mixed precision (the paper's Ψ = 7.5B, K = 12).
ZERO_7B5 = Config("zero-7.5b", "gpt", layers=36, d_model=4096, head_dim=128, vocab=32000, seq=1024,
                  batch=1, precision="bf16-mixed")


@dataclass(frozen=True)
class Run:
    source: str
    what: str                     # the setup in a few words, as the source names it
    config: Config
    strategy: str
    world_size: int
    memory: float | None = None   # per GPU, as published
    unit: str = "GiB"             # "GB" (1e9) or "GiB" (2**30)
    compared: str = "peak"        # what of the plan the memory is held against: "peak", "state"
                                  # (after the step) or "model_states" (forward to backward)
    tokens: float | None = None   # tokens per second per GPU, as published
    cannot: str = ""              # what the planner cannot express of this run; "" if nothing


def _zero_rows() -> list[Run]:
    table = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
             256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}
    rows = [Run(ZERO, "7.5B, data parallel (16Ψ)", ZERO_7B5, "ddp", 1, 120, "GB", "state")]
    why = {"zero1": ("Pos", "state"), "zero2": ("Pos+g", "model_states"), "fsdp": ("Pos+g+p", "state")}
    for n, values in table.items():
        if n == 1:
            continue
        for (strategy, (stage, compared)), value in zip(why.items(), values):
            rows.append(Run(ZERO, f"7.5B, {stage}, N_d={n}", ZERO_7B5, strategy, n, value, "GB", compared))
    return rows


_8B, _70B, _405B = CONFIGS["llama3.1-8b"], CONFIGS["llama3.1-70b"], CONFIGS["llama3.1-405b"]
_F8 = "Float8 linears and all-gathers, torch.compile"

RUNS: list[Run] = [
    *_zero_rows(),
    Run(TITAN, "Table 1: 8B, FSDP, 8 GPUs, local batch 2, selective AC", _8B, "fsdp", 8, 82.4, tokens=5762),
    Run(TITAN, "Table 1: 8B, FSDP + torch.compile", _8B, "fsdp", 8, 77.0, tokens=6667,
        cannot="torch.compile"),
    Run(TITAN, "Table 1: 8B, FSDP + torch.compile + Float8", _8B, "fsdp", 8, 76.8, tokens=8532, cannot=_F8),
    Run(TITAN, "Table 3: 8B, FSDP, 128 GPUs, local batch 2, selective AC", _8B, "fsdp", 128, 67.0,
        tokens=5605),
    Run(TITAN, "Table 3: 8B, FSDP + torch.compile", _8B, "fsdp", 128, 62.0, tokens=6514,
        cannot="torch.compile"),
    Run(TITAN, "Table 4: 70B, FSDP 32 x TP 8, 256 GPUs, local batch 16, full AC", _70B, "tp8+fsdp", 256,
        71.9, tokens=829, cannot=_F8),
    Run(TITAN, "Table 4: 70B, 2D + async TP", _70B, "tp8+fsdp", 256, 67.6, tokens=876,
        cannot=_F8 + ", async TP"),
    Run(TITAN, "Table 5: 405B, FSDP 8 x TP 8 x PP 8, 512 GPUs, local batch 32, full AC, 1F1B", _405B,
        "tp8+pp8+fsdp", 512, 82.5, tokens=100, cannot=_F8 + ", async TP"),
    Run(TITAN, "Table 5: 405B, interleaved 1F1B", _405B, "tp8+pp8v2+fsdp", 512, 72.7, tokens=128,
        cannot=_F8 + ", async TP"),
    Run(ASYNC_TP, "8B, FSDP 8 x TP 8, 64 GPUs, local batch 12, per-op SAC, bf16, vanilla TP",
        _8B.but(batch=12), "tp8+fsdp", 64, tokens=4378, cannot="torch.compile"),
    Run(ASYNC_TP, "70B, FSDP 32 x TP 8, 256 GPUs, local batch 16, full AC, bf16, vanilla TP",
        _70B, "tp8+fsdp", 256, tokens=597.3, cannot="torch.compile"),
]
# torchtitan's Table 1 FSDP row: the one run the efficiency is fitted on
CALIBRATION = RUNS[len(_zero_rows())]


def compare(runs: list[Run] | None = None, calibration: Run | None = CALIBRATION, timeout: float = 3600,
            say: Any = print) -> list[dict]:
    """Plan ``runs`` (default: all; those that share a model and batch in one plan) as their
    authors ran them, on "h100" and "nvlink+ib", the efficiency fitted on ``calibration`` alone;
    one dict per run: ``memory`` (planned, in the run's unit) and ``memory_ratio`` (planned /
    published), ``tokens`` (per second per GPU) and ``tokens_ratio``, or ``error``."""
    from . import plan

    runs = RUNS if runs is None else runs
    groups: dict = {}
    for run in [*runs, *([calibration] if calibration and calibration not in runs else [])]:
        groups.setdefault(run.config, []).append(run)
    plans = {}
    for config, members in groups.items():
        sizes = sorted({r.world_size for r in members})
        strategies = list(dict.fromkeys(r.strategy for r in members))
        started = time.perf_counter()
        plans[config] = plan(config, sizes, strategies, device="h100", network="nvlink+ib",
                             timeout=timeout)
        say(f"planned {config.name} ({', '.join(strategies)} at {sizes}) in "
            f"{time.perf_counter() - started:.0f} s (load {os.getloadavg()[0]:.1f})")
    efficiency = 0.4
    if calibration is not None:
        made = plans[calibration.config]
        base = made.row(calibration.strategy, calibration.world_size)
        efficiency = made.calibrated(base, calibration.tokens)
        say(f"efficiency fitted on {calibration.source}, {calibration.what}: {efficiency:.3f}")
    out = []
    for run in runs:
        row = plans[run.config].at_efficiency(efficiency).row(run.strategy, run.world_size)
        if row.error:
            out.append({"run": run, "error": row.error})
            continue
        state = sum(row.memory[k] for k in ("parameters", "gradients", "optimizer"))
        planned = {"peak": row.peak, "state": state, "model_states": row.model_states}[run.compared]
        memory = planned / (2**30 if run.unit == "GiB" else 1e9)
        out.append({"run": run, "memory": memory, "tokens": row.tokens_per_gpu, "efficiency": efficiency,
                    "memory_ratio": memory / run.memory if run.memory else None,
                    "tokens_ratio": row.tokens_per_gpu / run.tokens if run.tokens else None,
                    "calibration": run is calibration})
    return out


def markdown(compared: list[dict]) -> str:
    """The comparison as docs/plan.md's table."""
    lines = ["| source | run | strategy x GPUs | memory published | planned | ratio | tok/s/GPU published "
             "| planned | ratio | what the planner cannot express |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for got in compared:
        run = got["run"]
        head = f"| {run.source} | {run.what} | {run.strategy} x {run.world_size} |"
        if "error" in got:
            lines.append(f"{head} {run.memory or ''} | cannot: {got['error']} | | | | | "
                         f"{run.cannot or '-'} |")
            continue
        memory = (f" {run.memory:g} {run.unit} ({run.compared.replace('_', ' ')}) | {got['memory']:.3g} | "
                  f"{got['memory_ratio']:.2f} |" if run.memory else " | | |")
        tokens = (f" {run.tokens:g} | {got['tokens']:.4g} | "
                  + ("fitted |" if got["calibration"] else f"{got['tokens_ratio']:.2f} |") if run.tokens
                  else " | | |")
        lines.append(head + memory + tokens + f" {run.cannot or '-'} |")
    return "\n".join(lines)
