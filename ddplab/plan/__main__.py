"""``python -m ddplab.plan llm-8b --world-sizes 8 64 1024``: a plan's table on the command line.

Every argument is checked before the tracing starts (a ``--plot`` path that cannot be
written included); a bad one ends the command with its reason and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import ConfigError
from . import CONFIGS, DEFAULT_STRATEGIES, INTERCONNECTS, RECIPES, inputs, plan
from .compute import DEVICES
from .models import CHECKPOINTING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddplab.plan",
                                     description="Memory per rank and step time, per strategy.")
    parser.add_argument("model", nargs="?", default="llm-8b", choices=list(CONFIGS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    parser.add_argument("--device", default="h100", choices=[*DEVICES, "this-cpu"])
    parser.add_argument("--network", default="nvlink+ib", choices=list(INTERCONNECTS))
    parser.add_argument("--efficiency", type=float, default=0.4,
                        help="share of the device's peak FLOP/s a step reaches, in (0, 1]")
    parser.add_argument("--batch", type=int, help="sequences per replica per step")
    parser.add_argument("--precision", choices=list(RECIPES), help="the model's recipe instead of its own")
    parser.add_argument("--checkpointing", choices=list(CHECKPOINTING))
    parser.add_argument("--timeout", type=float, default=600, help="seconds the tracing may take")
    parser.add_argument("--plot", metavar="PNG", help="also save the picture to this file")
    args = parser.parse_args(argv)
    changes = {k: getattr(args, k) for k in ("batch", "precision", "checkpointing")
               if getattr(args, k) is not None}
    try:
        if args.plot:
            inputs.output_path(args.plot)
        config = CONFIGS[args.model].but(**changes)
        start = time.perf_counter()
        made = plan(config, args.world_sizes, args.strategies, args.device, args.network,
                    args.efficiency, timeout=args.timeout)
    except ConfigError as e:
        print(f"{e}", file=sys.stderr)
        return 2
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
