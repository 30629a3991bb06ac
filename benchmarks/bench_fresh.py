"""What fresh code on the ranks costs a call (``ddplab.rank.fresh``, ``ddplab.lab.shipping``).

Before each job, each rank looks at the files of the user's modules it loaded
and reloads those that changed; the job itself is pickled by the kernel once
and unpickled on the rank after that look (``engine.call_pickled``). Measured:

1. On a rank, no messages: one ``fresh.refresh`` with k of the user's modules
   loaded (k = 0, 10, 100, 300: a notebook's few; a project installed with
   ``pip install -e .``), nothing changed, files settled (mtime older than
   ``fresh.RACY_NS``) and just written (read again until they settle); one
   edited module (its reload); and the first import of a module through
   ``fresh._Loader``, compiled or from a settled ``.pyc``, against Python's
   loader with the same ``.pyc``.
2. The round trip of an empty call on the ranks, side by side and alternately:
   raw ipyparallel ``apply_sync``; ``engine.call`` through it (what ``lab.run``
   sent before, the function pickled by ipyparallel, nothing refreshed);
   ``engine.call_pickled`` through it with the kernel's ``sys.path`` (what it
   sends now); and ``lab.run`` itself.

Run: ``.venv/bin/python benchmarks/bench_fresh.py [--world-size 2] [--calls 300]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

MODULE = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(60)) + "VALUE = 1\n"


def _nothing() -> None:
    return None


def _write(sub: str, names: list[str], settled: bool) -> None:
    """Modules of ``MODULE``'s text; ``settled``: their mtime 10 s ago, each with a ``.pyc``."""
    import os
    import py_compile
    os.makedirs(sub, exist_ok=True)
    for name in names:
        path = os.path.join(sub, f"{name}.py")
        with open(path, "w") as f:
            f.write(MODULE)
        if settled:
            old = time.time() - 10
            os.utime(path, (old, old))
            py_compile.compile(path)


def refresh_costs(folder: str, counts: list[int], calls: int) -> dict:
    """On a rank: seconds per ``fresh.refresh`` for each count of loaded modules, and the rest."""
    import importlib
    import os
    import sys

    from ddplab.rank import engine, fresh

    ns = engine.namespace()
    out: dict = {"settled": {}, "just written": {}}
    for settled in (True, False):
        for k in counts:
            tag = f"{'s' if settled else 'w'}{k}_{os.getpid()}"
            sub, names = os.path.join(folder, tag), [f"bench_{tag}_{i}" for i in range(k)]
            _write(sub, names, settled)
            sys.path.insert(0, sub)
            for name in names:
                importlib.import_module(name)
            fresh.refresh(ns, list(sys.path))
            began = time.perf_counter()
            for _ in range(calls):
                fresh.refresh(ns, list(sys.path))
            out["settled" if settled else "just written"][k] = (time.perf_counter() - began) / calls
            if names and not settled and k == counts[-1]:        # one edited module: its reload
                with open(sys.modules[names[0]].__file__, "a") as f:
                    f.write("VALUE = 2\n")
                began = time.perf_counter()
                fresh.refresh(ns, list(sys.path))
                out["reload of one module"] = time.perf_counter() - began
                assert sys.modules[names[0]].VALUE == 2
            sys.path.remove(sub)
            for name in names:
                del sys.modules[name]                 # the next count is measured alone
    out["first import, per module"] = first_imports(folder, max(counts))
    return out


def first_imports(folder: str, k: int) -> dict[str, float]:
    """Seconds per first import of a module through ``fresh._Loader`` (compiled; from a
    settled ``.pyc``) and through Python's loader with the same ``.pyc``."""
    import importlib
    import os
    import sys

    from ddplab.rank import fresh

    found: dict[str, float] = {}
    for how in ("fresh._Loader, compiled", "fresh._Loader, a settled .pyc",
                "Python's loader, a .pyc"):
        tag = f"first{len(found)}_{os.getpid()}"
        sub, names = os.path.join(folder, tag), [f"bench_{tag}_{i}" for i in range(k)]
        _write(sub, names, settled="pyc" in how)
        finders = list(sys.meta_path)
        if how.startswith("Python"):          # this rank's meta_path without fresh's finder
            sys.meta_path[:] = [f for f in finders if type(f).__module__ != fresh.__name__]
        sys.path.insert(0, sub)
        importlib.invalidate_caches()
        began = time.perf_counter()
        for name in names:
            importlib.import_module(name)
        found[how] = (time.perf_counter() - began) / k
        sys.path.remove(sub)
        sys.meta_path[:] = finders
        for name in names:
            del sys.modules[name]
    return found


def round_trips(lab, calls: int) -> dict[str, float]:
    """Median seconds per empty call, each way, the ways taken in turn."""
    from ddplab.lab import shipping
    from ddplab.rank import engine

    view = lab.engines.engine_set.view(tuple(lab.ranks))
    ways = {
        "raw ipyparallel apply_sync": lambda: view.apply_sync(_nothing),
        "engine.call (lab.run before)": lambda: view.apply_sync(engine.call, _nothing, (), {}, {}),
        "engine.call_pickled (lab.run now)": lambda: view.apply_sync(
            engine.call_pickled, shipping.pack("bench", _nothing), (), {}, shipping.kernel_path()),
        "lab.run": lambda: lab.run(_nothing),
    }
    for way in ways.values():           # warm up every way
        for _ in range(5):
            way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(calls):
        for name, way in ways.items():
            began = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def packing(calls: int = 2000) -> float:
    """Seconds per ``shipping.pack`` of an empty notebook function, with ``kernel_path``."""
    from ddplab.lab import shipping
    began = time.perf_counter()
    for _ in range(calls):
        shipping.pack("bench", _nothing), shipping.kernel_path()
    return (time.perf_counter() - began) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    import os

    import ddplab
    print(f"load average {os.getloadavg()[0]:.1f}")
    with ddplab.start(world_size=args.world_size, backend="gloo") as lab, \
            tempfile.TemporaryDirectory() as folder:
        print(f"round trip of an empty call on {args.world_size} ranks (median of {args.calls}, in turn):")
        trips = round_trips(lab, args.calls)
        raw = trips["raw ipyparallel apply_sync"]
        for name, s in trips.items():
            print(f"  {name:36} {s * 1e3:7.2f} ms  {s / raw:5.2f}x raw")
        print(f"  of which in the kernel, shipping.pack and kernel_path: {packing() * 1e6:.0f} us")
        costs = lab.run(refresh_costs, folder, [0, 10, 100, 300], 200, ranks=[0])[0]
        print("on a rank, one refresh with k of the user's modules loaded, nothing changed:")
        for kind in ("settled", "just written"):
            print(f"  {kind:13}" + "".join(f"  k={k}: {s * 1e6:8.1f} us"
                                          for k, s in costs[kind].items()))
        print(f"  reload of one edited module of 300 (and rebinding): "
              f"{costs['reload of one module'] * 1e3:.2f} ms")
        for how, s in costs["first import, per module"].items():
            print(f"  first import of a {len(MODULE)}-byte module, {how}: {s * 1e6:.0f} us")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
