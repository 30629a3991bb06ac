"""The install profiles side by side: size and time of what `make lab` and `make test` install.

Each profile is installed the way the Makefile installs it, into a fresh virtual environment
in a temporary folder (removed afterwards): `python -m venv`, pip upgraded, then
`pip install -c constraints.txt -e '<checkout>[extras]'`. Timed is the whole of it: wall
clock, and the CPU time of those processes (user + system), which a loaded machine stretches
far less; measured after it, the environment's size on disk and how many distributions it
holds, and which of the instructor's and the tests' tools are in it.

pip runs with this machine's own configuration: its package index, its local mirrors and
wheel folders (on the development machine, torch's CPU wheel from /opt/wheels and the rest
from file:// mirrors: a local cache, not the internet), its HTTP cache. So the times say
what a fresh `make lab` costs *here*; on another machine the network decides. The load
average is printed before and after each install: a shared machine's load changes the times
more than anything else, so compare profiles within one run (``--repeat`` alternates them).

    python benchmarks/bench_install.py [--repeat N] [--profiles student,test]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The Makefile's profiles (PROFILE.<name> there): what each pip install is given.
PROFILES = {"student": ".", "instructor": ".[instructor]", "docs": ".[docs]",
            "test": ".[instructor,docs,test]"}
TOOLS = ("nbgrader", "jupyterhub", "playwright", "pytest", "mkdocs", "nbval", "ruff")


def _size(folder: Path) -> int:
    """Bytes of disk the folder takes, as ``du -s`` counts them (blocks; links not followed)."""
    total = 0
    for dirpath, dirs, files in os.walk(folder):
        for name in files + dirs:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _children_cpu() -> float:
    """CPU seconds (user + system) of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def install(profile: str, base: Path) -> dict:
    """Install ``profile`` into a fresh venv under ``base``; its time, size, count and tools."""
    venv = base / f"venv-{profile}"
    python = venv / "bin" / "python"
    load_before = _load()
    began, cpu_before = time.monotonic(), _children_cpu()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True,
                   stderr=subprocess.DEVNULL)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e",
                    PROFILES[profile]], check=True, cwd=ROOT, stderr=subprocess.DEVNULL)
    seconds, cpu = time.monotonic() - began, _children_cpu() - cpu_before
    names = subprocess.run([str(python), "-c", "import importlib.metadata as m\n"
                            "for d in m.distributions(): print(d.metadata['Name'].lower())"],
                           check=True, capture_output=True, text=True).stdout.split()
    result = {"profile": profile, "seconds": seconds, "cpu": cpu, "bytes": _size(venv),
              "packages": len(set(names)), "tools": sorted(t for t in TOOLS if t in names),
              "load": f"{load_before} -> {_load()}"}
    shutil.rmtree(venv)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="rounds, the profiles alternating")
    parser.add_argument("--profiles", default="student,test", help="comma-separated, in order")
    args = parser.parse_args(argv)
    profiles = args.profiles.split(",")
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        parser.error(f"no install profile {unknown}: one of {', '.join(PROFILES)}")
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, pip configured as this machine has it")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-install-") as tmp:
        for round_ in range(args.repeat):
            order = profiles if round_ % 2 == 0 else profiles[::-1]
            for profile in order:
                row = install(profile, Path(tmp))
                rows.append(row)
                print(f"{profile:<10} {row['seconds']:6.1f} s (CPU {row['cpu']:5.1f} s)  "
                      f"{row['bytes'] / 1e9:5.2f} GB  "
                      f"{row['packages']:3d} packages  tools: {', '.join(row['tools']) or 'none'}  "
                      f"(load {row['load']})", flush=True)
    print("\n| profile | time | CPU time | size | packages | instructor and test tools "
          "| load before -> after |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        minutes, seconds = divmod(round(row["seconds"]), 60)
        print(f"| {row['profile']} | {minutes} min {seconds:02d} s | {row['cpu']:.0f} s | "
              f"{row['bytes'] / 1e9:.2f} GB | "
              f"{row['packages']} | {', '.join(row['tools']) or 'none'} | {row['load']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
