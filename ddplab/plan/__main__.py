"""``python -m ddplab.plan llm-1b --world-sizes 8 64 1024``: a plan's table on the command line."""

from __future__ import annotations

import argparse
import time

from . import CONFIGS, DEFAULT_STRATEGIES, INTERCONNECTS, plan
from .compute import DEVICES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddplab.plan",
                                     description="Memory per rank and step time, per strategy.")
    parser.add_argument("model", nargs="?", default="llm-1b", choices=list(CONFIGS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    parser.add_argument("--device", default="h100", choices=[*DEVICES, "this-cpu"])
    parser.add_argument("--network", default="nvlink+ib", choices=list(INTERCONNECTS))
    parser.add_argument("--efficiency", type=float, default=0.4, help="share of peak FLOP/s reached")
    parser.add_argument("--batch", type=int, help="sequences per replica per step")
    parser.add_argument("--plot", metavar="PNG", help="also save the picture to this file")
    args = parser.parse_args(argv)
    config = CONFIGS[args.model] if args.batch is None else CONFIGS[args.model].but(batch=args.batch)
    start = time.perf_counter()
    made = plan(config, args.world_sizes, args.strategies, args.device, args.network, args.efficiency)
    print(made.table())
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        made.picture().savefig(args.plot, dpi=100)
        print(f"picture saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
