"""The ``ddplab`` command: ``ddplab doctor`` checks that this machine can run a lab."""

from __future__ import annotations

import argparse
import sys
import time


def doctor() -> int:
    """Print torch, backends and GPUs, then start and stop a 2-rank lab as a self-test."""
    import torch
    import torch.distributed as dist

    import ddplab
    from ddplab.env import gpu_count

    print(f"python      {sys.version.split()[0]}")
    print(f"torch       {torch.__version__}")
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    print(f"backends    {', '.join(backends) or 'none'}")
    gpus = gpu_count()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"GPUs        {gpus}" + (f" ({', '.join(names)})" if names else ""))
    print("self-test   starting a 2-rank lab ...", flush=True)
    begin = time.perf_counter()
    try:
        with ddplab.start(world_size=2, timeout=60) as lab:
            sums = lab.run(_all_reduce_rank)
            started = time.perf_counter() - begin
        assert sums == [1.0, 1.0], f"all_reduce gave {sums}, expected [1.0, 1.0]"
    except Exception as exc:
        print(f"self-test   FAILED: {exc}")
        return 1
    print(f"self-test   ok: 2 ranks, backend {lab.backend}, all_reduce correct, "
          f"{started:.1f} s, stopped cleanly")
    return 0


def _all_reduce_rank() -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddplab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check torch, backends and GPUs, and self-test a 2-rank lab")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
