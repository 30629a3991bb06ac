"""Where `make test`'s time went: the JUnit XML that pytest wrote, summed by test module.

    python tools/test_times.py build/test-results.xml [--top 25]

pytest's ``--durations`` names the slowest single tests; this sums every test of
a module (setup, call and teardown, as JUnit's ``time`` counts them), so a
module of many medium tests shows too. Each notebook that nbval runs is its own
row. The last line is the whole run's wall time as pytest measured it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from xml.etree import ElementTree


def module_of(case: ElementTree.Element) -> str:
    """``tests/test_x.py`` for a test, ``notebooks/NN.ipynb`` for a notebook's cell."""
    classname = case.get("classname", "")
    file = case.get("file")
    if file:
        return file
    # pytest writes "tests.test_x" (module) or "tests.test_x.TestClass"; nbval "notebooks.01_x.ipynb"
    if ".ipynb" in classname:
        return classname.replace(".", "/", 1)
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else classname


def times_by_module(path: Path) -> tuple[dict[str, float], dict[str, int], float]:
    """({module: seconds}, {module: tests}, the run's seconds) from one JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for case in root.iter("testcase"):
        name = module_of(case)
        seconds[name] += float(case.get("time", 0) or 0)
        count[name] += 1
    return dict(seconds), dict(count), sum(float(s.get("time", 0) or 0) for s in suites)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if not args.xml.is_file():
        print(f"test_times: no {args.xml}: run `make test` (it writes it) first", file=sys.stderr)
        return 1
    seconds, count, total = times_by_module(args.xml)
    print(f"\nTime by test module (top {args.top} of {len(seconds)}):")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{s:8.1f} s {count[name]:5d} tests  {name}")
    print(f"{sum(seconds.values()):8.1f} s in tests; {total:.1f} s for the whole run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
