"""What capturing a rank's output costs: N short lines on a rank vs in a plain kernel.

The same loop, ``for step in range(N): print(f'step {step} loss 0.1234')``,
runs in two Jupyter kernels started with jupyter_client, as a notebook would
run it:

- plain: the loop in the kernel itself;
- ddplab: the loop in a ``%%ranks`` cell of a 1-rank lab started in the kernel
  (one rank, so both print the same amount).

Each figure is the time from sending the cell to the kernel going idle with
every output message received, so it includes getting the text to the front
end. Past ``ddplab.rank.output.KEEP_HEAD + KEEP_TAIL`` characters (1 MiB) a
rank keeps only the head and the tail, so the ddplab side sends less for 100k
and 1M lines: the plain kernel sends the whole 23 MB.

Run: ``.venv/bin/python benchmarks/bench_output.py [--lines 10000 100000 1000000]``

Measured on the shared 2-core machine under load (load average ~16), 2026-11-23::

        lines  plain kernel  ddplab rank  ratio   chars sent (plain / ddplab)
       10,000         0.27s        0.04s   0.16   218,890 / 218,899
      100,000         2.07s        0.37s   0.18   2,288,890 / 1,048,722
    1,000,000        20.37s        5.93s   0.29   23,888,890 / 1,048,719

Before linear capture, 100k lines on a rank took about 80 s (issue 19).

Capturing fd 1 and 2 too (``ddplab.rank.fdcapture``) left ``print`` as it was:
three alternating runs each, load average ~3-5, 100k lines on the rank took
0.21/0.14/0.36 s before and 0.14/0.20/0.13 s after; 100k prints in-process
through the recorder, best of 8: 0.097 s before, 0.102 s after.
"""

from __future__ import annotations

import argparse
import sys
import time

from jupyter_client.manager import start_new_kernel

LOOP = "for step in range({n}):\n    print(f'step {{step}} loss 0.1234')"


def run(client, code: str, limit: float = 900) -> tuple[float, int]:
    """Execute ``code``; (seconds until idle, characters of stream output received)."""
    begin = time.monotonic()
    msg_id = client.execute(code)
    chars = 0
    while True:
        msg = client.get_iopub_msg(timeout=limit)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            chars += len(msg["content"]["text"])
        elif kind == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return time.monotonic() - begin, chars


def kernel():
    manager, client = start_new_kernel(kernel_name="python3",
                                       extra_arguments=[], startup_timeout=120)
    run(client, f"import sys; assert sys.executable == {sys.executable!r}, sys.executable")
    return manager, client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    plain, plain_client = kernel()
    lab, lab_client = kernel()
    try:
        run(lab_client, "import ddplab\nlab = ddplab.start(world_size=1, backend='gloo', timeout=900)")
        print(f"{'lines':>9} {'plain kernel':>13} {'ddplab rank':>12} {'ratio':>6}   "
              f"chars sent (plain / ddplab)")
        for n in args.lines:
            base, base_chars = run(plain_client, LOOP.format(n=n))
            ours, our_chars = run(lab_client, "%%ranks\n" + LOOP.format(n=n))
            print(f"{n:>9,} {base:>12.2f}s {ours:>11.2f}s {ours / base:>6.2f}   "
                  f"{base_chars:,} / {our_chars:,}", flush=True)
        run(lab_client, "lab.stop()")
    finally:
        for manager, client in ((plain, plain_client), (lab, lab_client)):
            client.stop_channels()
            manager.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
