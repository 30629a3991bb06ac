"""Start-up of a 4-rank lab on 2 SSH hosts, side by side with a local 4-rank lab.

The SSH hosts are real: two key-only sshds in network namespaces on a private
bridge, named by ssh-config aliases (``tests/realhosts.py``'s ``ssh_network``),
so it needs root. Each side is a fresh Python process (a fresh kernel: torch is
imported once per engine, or once by a local lab's engine template), timed from
``ddplab.start`` to the end of a barrier on every rank; sides alternate,
``--repeat`` times, and we compare medians. Goal: SSH <= 3x local.

Run (as root): ``.venv/bin/python benchmarks/bench_hosts.py [--repeat 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
START = """
import json, sys, time
import ddplab
import torch.distributed as dist
begin = time.perf_counter()
lab = ddplab.start(world_size=4, backend="gloo", timeout=60, **json.loads(sys.argv[1]))
lab.run(dist.barrier)
print(time.perf_counter() - begin)
lab.stop()
"""


def time_start(args: dict) -> float:
    out = subprocess.run([sys.executable, "-c", START, json.dumps(args)], capture_output=True,
                         text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"start failed ({args}):\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_hosts: the SSH hosts are network namespaces with their own sshd: "
                         "run as root")
    sys.path.insert(0, str(HERE.parent / "tests"))
    from realhosts import ssh_network

    with ssh_network() as hosts:
        ssh = {"hosts": hosts.aliases, "ssh_cmd": hosts.ssh_cmd}
        local, remote = [], []
        for _ in range(opts.repeat):
            local.append(time_start({}))
            remote.append(time_start(ssh))
    lm, rm = statistics.median(local), statistics.median(remote)
    print(f"local 4-rank lab, start + barrier:            median {lm:5.2f} s  "
          f"({', '.join(f'{t:.2f}' for t in local)})")
    print(f"4 ranks on 2 SSH hosts (aliases), same:       median {rm:5.2f} s  "
          f"({', '.join(f'{t:.2f}' for t in remote)})")
    print(f"ratio SSH / local: {rm / lm:.2f} (goal <= 3)")


if __name__ == "__main__":
    main()
