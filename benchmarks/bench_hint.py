"""A student's first ``ddplab.hint`` in a fresh kernel: the notebooks read as JSON, against the
way before issue 53 (nbformat), side by side.

The first hint of a kernel reads every reference notebook for its exercise cells. It used
``nbformat.read``, and importing nbformat imports its jsonschema validator, which compiles
a grammar (``rfc3987_syntax``) on import: about 1 s of CPU on an idle machine, 11-12 s seen
on a loaded one. ``ddplab.hints`` now reads the notebooks with ``json``. Each measurement is
a fresh Jupyter kernel (what a student has): a first cell imports ddplab, untimed; the
second is timed inside the kernel. The two ways alternate, so both see the same load.

Run: ``.venv/bin/python benchmarks/bench_hint.py [--repeat 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics

from jupyter_client.manager import start_new_kernel

GOAL_S = 1.0
# What ddplab.hint did before: nbformat.read of every reference notebook.
BEFORE = """\
import time as _t
_begin = _t.perf_counter()
import nbformat
from ddplab.hints import reference_notebooks
_found = {}
for _path in reference_notebooks():
    for _cell in nbformat.read(_path, as_version=4).cells:
        if _cell.get("id", "").startswith("exercise-"):
            _found.setdefault(_cell.id[len("exercise-"):], (_path.name, _cell))
_hint = _found["ping-pong"][1].metadata["ddplab"]["hint"]
print("seconds", _t.perf_counter() - _begin)"""
NOW = """\
import time as _t
_begin = _t.perf_counter()
ddplab.hints.hint_text("ping-pong")
print("seconds", _t.perf_counter() - _begin)"""


def _run(client, code: str) -> str:
    msg_id = client.execute(code)
    text = []
    while True:
        msg = client.get_iopub_msg(timeout=300)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise RuntimeError(f"{msg['content']['ename']}: {msg['content']['evalue']}")
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text)


def first_call(code: str) -> float:
    """Seconds ``code`` takes in a fresh kernel that has imported ddplab (and nothing else)."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        _run(client, "import ddplab")
        return float(_run(client, code).split()[-1])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    before, now = [], []
    load = os.getloadavg()[0]
    for _ in range(args.repeat):
        before.append(first_call(BEFORE))
        now.append(first_call(NOW))
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}, {args.repeat} fresh kernels each")
    for name, times in (("before (nbformat)", before), ("now (json)", now)):
        print(f"{name:18} median {statistics.median(times):.3f} s, max {max(times):.3f} s")
    ratio = statistics.median(now) / statistics.median(before)
    verdict = "meets" if max(now) < GOAL_S else "misses"
    print(f"ratio {ratio:.2f}x; the slowest first hint now {verdict} the goal of {GOAL_S:g} s")


if __name__ == "__main__":
    main()
