"""The child processes that trace a plan's cases, and what the kernel reads back.

    measure(config, [("fsdp", 64), ("ddp", 8)], timeout=600)    # {("fsdp", 64): {...}, ...}

Each case is traced (``ddplab.plan.memory.trace``) and its FLOPs counted
(``ddplab.plan.flops.stage``) in a child process (``ddplab.procs.run``), one per core
up to 4, so that the fake process group never replaces a real lab's default group in
the notebook's kernel, and a case that torch cannot trace costs its row, not the plan.
A strategy's cases stay in one child (ddp's, which shard nothing, are traced once).
"""

from __future__ import annotations

import json
import sys

from ..errors import DdplabError
from .models import Config
from .strategies import parse

__all__ = ["main", "measure"]


def measure(config: Config, cases: list[tuple[str, int]],
            timeout: float = 600) -> dict[tuple[str, int], dict]:
    """Trace every (strategy, world size); a case torch cannot trace comes back as
    ``{"error": ...}``, not as an exception. More than ``timeout`` seconds: an error that
    says so."""
    import os
    from pathlib import Path

    from .. import procs

    by_strategy: dict[str, list] = {}
    for strategy, n in cases:
        by_strategy.setdefault(parse(strategy).name, []).append([parse(strategy).name, n])
    workers = max(1, min(len(os.sched_getaffinity(0)), 4, len(by_strategy)))
    shares: list[list] = [[] for _ in range(workers)]
    for group in sorted(by_strategy.values(), key=lambda g: _cost(config, g), reverse=True):
        min(shares, key=lambda share: _cost(config, share)).extend(group)
    here = str(Path(__file__).resolve().parents[2])          # where this ddplab is imported from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    child = "import sys; from ddplab.plan.children import main; sys.exit(main(sys.argv[1:]))"
    commands = [[sys.executable, "-c", child, json.dumps({"config": config.to_dict(), "cases": share})]
                for share in shares if share]
    done = procs.run(commands, timeout, env=env, output="all")
    results = {}
    for ended in done:
        for line in ended.output.splitlines():
            if line.startswith('{"strategy"'):
                row = json.loads(line)
                results[(row.pop("strategy"), row.pop("world_size"))] = row
    if not done.ok or len(results) < len(cases):
        tail = "\n".join(line for ended in done for line in ended.output.strip().splitlines()[-8:]
                         if not line.startswith('{"strategy"'))
        why = (f"did not finish within timeout={timeout:g} s" if done.timed_out
               else f"ended with codes {done.returncodes}")
        raise DdplabError(f"ddplab.plan: the children that trace memory {why}, after "
                          f"{len(results)} of {len(cases)} cases:\n{tail}\nGive a longer timeout "
                          f"(ddplab.plan(..., timeout=...)), or fewer or smaller cases.")
    return results


def _cost(config: Config, cases: list) -> float:
    """A rough share of a child's work, from the CPU seconds cases took here (llm-8b, 2026-11-28):
    a case about 1 (blocks read off a line), tp half again (DTensor), a pipeline 1.7 (two
    ends, under fsdp two micro-batches each); ddp is traced once per child, and zero1 is
    ddp's forward and backward (once per child) and a step of its own (0.3)."""
    total, names = 0.0, set()
    for name, _ in cases:
        strategy = parse(name)
        base = {"ddp", "zero1"} & {strategy.data}
        if base and "local" not in names:
            total, names = total + 1.0, names | {"local"}
        if strategy.data == "ddp":
            continue
        total += 0.3 if strategy.data == "zero1" else (1.5 if strategy.tp > 1 else 1.0) * (
            1.7 if strategy.pp > 1 else 1.0)
    return total


def main(argv: list[str] | None = None) -> int:
    """The child: one JSON line per case on stdout."""
    import warnings

    from . import flops
    from .memory import trace

    warnings.filterwarnings("ignore")          # FSDP's view warning, once per case, is noise here
    request = json.loads((argv or sys.argv[1:])[0])
    config = Config(**request["config"])
    done: dict[str, dict] = {}
    for name, world_size in request["cases"]:
        strategy = parse(name)
        if strategy.data == "ddp" and name in done:   # ddp shards nothing: the same at every size
            row = done[name]
        else:
            try:
                row = trace(config, strategy, world_size)
                ends = {0, strategy.pp - 1}
                counted = [flops.stage(config, strategy.pp, strategy.virtual, r) for r in sorted(ends)]
                row["flops"] = max(c["flops"] for c in counted) // strategy.tp
                row["uncounted"] = sorted({op for c in counted for op in c["uncounted"]})
            except Exception as e:                    # a strategy torch cannot trace: say so, go on
                first = str(e).splitlines()[0][:200] if str(e) else ""
                row = {"error": f"{type(e).__name__}: {first}"}
            done[name] = row
        print(json.dumps({"strategy": name, "world_size": world_size, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
