"""Time collectives on a lab: time, algorithm bandwidth and bus bandwidth, as nccl-tests reports them.

    python -m ddplab.bench                      # 4 KB..64 MB on 2 and 4 ranks, a table and a fit
    python -m ddplab.bench --world-sizes 4 --sizes 1M 16M --plot bench.png

    results = ddplab.bench.sweep(lab, sizes=["64K", "1M"])       # in a notebook, on its lab
    print(ddplab.bench.table(results)); ddplab.bench.plot(results)

Definitions (nccl-tests, doc/PERFORMANCE.md):

- ``time``: one call, from the slowest rank's point of view (each rank times a
  loop of calls; the maximum over ranks counts). Of several repetitions the
  best is kept: on a shared machine the others only measure the neighbours.
- ``algbw = S / time``, S the bytes of the collective: the tensor for
  all_reduce and broadcast, the *gathered output* for all_gather.
- ``busbw = algbw * factor``: the bandwidth each link must carry, so that it
  can be compared with the hardware's and across world sizes. For n ranks the
  factor is 2(n-1)/n for all_reduce, 1 for broadcast, (n-1)/n for all_gather
  and reduce_scatter: a ring all_reduce sends 2(n-1)/n * S bytes per rank.

``fit_ring`` fits the ring's α-β cost model T = 2(p-1)(α + (m/p)β) to the
ring's times and ``machine`` measures α and β of a plain send/recv between
two ranks, so you can see what the ring adds to the wire: the reduction.

The command line starts its own labs (``ddplab.start``, one per world size)
rather than running under torchrun, so the notebook and the command line time
exactly the same code, through the same ``lab.run``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import ConfigError
from .text import plural

__all__ = ["FACTORS", "Result", "busbw_factor", "fit_ring", "machine", "main", "measure",
           "parse_size", "plot", "spell_size", "sweep", "table"]

FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}
DEFAULT_SIZES = ("4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M")
_ELEMENT = 4                                    # float32: every benchmark tensor
_LOOP_BYTES = 8 << 20                           # small sizes repeat a call until this many bytes


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * factor."""
    if collective not in FACTORS:
        raise ConfigError(f"ddplab.bench: no bus bandwidth factor for {collective!r}; "
                         f"use one of {', '.join(FACTORS)}.")
    return FACTORS[collective](world_size)


@dataclass(frozen=True)
class Result:
    """One measurement: ``name`` ran ``collective`` on ``nbytes`` bytes over ``world_size`` ranks."""
    collective: str
    name: str
    world_size: int
    nbytes: int
    seconds: float

    @property
    def algbw(self) -> float:
        """Bytes per second of the collective's size S."""
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * busbw_factor(self.collective, self.world_size)


def parse_size(size: int | str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864, ``"16MB"`` too; ints pass through."""
    if isinstance(size, int):
        return size
    text = size.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(float(text.rstrip("KMG")) * scale)
    except ValueError:
        raise ConfigError(f"ddplab.bench: cannot read the size {size!r}; write bytes like "
                         f"4096, 4K, 16M or 1G.") from None


def spell_size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------ on the ranks
def _device() -> Any:
    """On a rank: where its tensors live: its own GPU under nccl (which moves CUDA tensors only)."""
    import torch.distributed as dist

    from .train import device_for_this_rank

    return device_for_this_rank() if dist.get_backend() == "nccl" else "cpu"


def _finish(device: Any) -> None:
    """Wait for the device's queued work: nccl's calls return before the GPU has done them."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def _operation(collective: str, fn: Callable | None, nbytes: int) -> Callable[[], Any]:
    """On a rank: a no-argument call of the collective on ``nbytes`` bytes."""
    import torch
    import torch.distributed as dist

    world_size, device = dist.get_world_size(), _device()
    count = max(1, nbytes // _ELEMENT)
    if collective == "all_gather":
        # nccl-tests' size is the gathered output: each rank adds 1/n of it.
        piece = torch.zeros(max(1, count // world_size), device=device)
        out = torch.empty(piece.numel() * world_size, device=device)
        gather = fn or getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, piece)
    tensor = torch.zeros(count, device=device)   # zeros: summing them again and again never overflows
    if collective == "broadcast":
        cast = fn or dist.broadcast
        return lambda: cast(tensor, src=0)
    if collective == "all_reduce":
        reduce = fn or dist.all_reduce
        return lambda: reduce(tensor)
    raise ConfigError(f"ddplab.bench: cannot time {collective!r}; use all_reduce, broadcast or all_gather.")


def _time_on_rank(collective: str, fn: Callable | None, nbytes: int, repeats: int) -> float:
    """On every rank: the best, over ``repeats``, of the slowest rank's mean time per call."""
    import torch
    import torch.distributed as dist

    op, device = _operation(collective, fn, nbytes), _device()
    loops = max(1, min(50, _LOOP_BYTES // max(1, nbytes)))
    op()                                              # warm up: first-touch memory, lazy set-up
    best = float("inf")
    for _ in range(repeats):
        _finish(device)
        dist.barrier()                                # everyone starts together
        start = time.perf_counter()
        for _ in range(loops):
            op()
        _finish(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / loops], dtype=torch.float64,
                               device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)    # a collective is as slow as its slowest rank
        best = min(best, elapsed.item())
    return best


def _pingpong_on_rank(nbytes: int, repeats: int) -> float:
    """On ranks 0 and 1: the best one-way time of a send of ``nbytes`` (half a round trip)."""
    import torch
    import torch.distributed as dist

    rank, device = dist.get_rank(), _device()
    tensor = torch.zeros(max(1, nbytes // _ELEMENT), device=device)
    loops = max(1, min(50, _LOOP_BYTES // max(1, nbytes)))
    best = float("inf")
    for _ in range(repeats + 1):                      # the first round is a warm-up
        start = time.perf_counter()
        for _ in range(loops):
            if rank == 0:
                dist.send(tensor, dst=1)
                dist.recv(tensor, src=1)
            else:
                dist.recv(tensor, src=0)
                dist.send(tensor, dst=0)
        _finish(device)
        best = min(best, (time.perf_counter() - start) / loops / 2)
    return best


def _add_on_rank(nbytes: int, repeats: int) -> float:
    """On a rank: the best time of ``a += b`` on ``nbytes``, the ring's reduction step."""
    import torch

    device = _device()
    a, b = torch.zeros(nbytes // _ELEMENT, device=device), torch.zeros(nbytes // _ELEMENT, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        _finish(device)
        start = time.perf_counter()
        a += b
        _finish(device)
        best = min(best, time.perf_counter() - start)
    return best


# ------------------------------------------------------------ in the kernel
def measure(lab: Any, collective: str, name: str, fn: Callable | None,
            sizes: Iterable[int | str], repeats: int = 5) -> list[Result]:
    """Time ``fn`` (None: torch's own ``dist.<collective>``) on every size; one Result per size."""
    busbw_factor(collective, lab.world_size)            # an unknown collective fails here, early
    results = []
    for size in sizes:
        nbytes = parse_size(size)
        seconds = lab.run(_time_on_rank, collective, fn, nbytes, repeats,
                          timeout=max(lab.spec.timeout, 600))[0]
        if collective == "all_gather":                  # what was really gathered
            nbytes = max(1, nbytes // _ELEMENT // lab.world_size) * lab.world_size * _ELEMENT
        results.append(Result(collective, name, lab.world_size, nbytes, seconds))
    return results


def implementations(collective: str) -> dict[str, Callable | None]:
    """What ``sweep`` times for a collective: torch's own, then ddplab's send/recv ones."""
    from .algorithms import ALL_REDUCE

    own = {f"dist.{collective}": None}
    return {**own, **ALL_REDUCE} if collective == "all_reduce" else own


def sweep(lab: Any, collectives: Iterable[str] = ("all_reduce",), sizes: Iterable[int | str] = DEFAULT_SIZES,
          repeats: int = 5, extra: dict[str, Callable] | None = None,
          progress: Callable[[str], None] | None = None) -> list[Result]:
    """Time every implementation of each collective on every size, on ``lab``'s ranks.

    ``extra`` adds your own all_reduce functions, e.g. ``{"my ring": my_ring_all_reduce}``.
    """
    results = []
    for collective in collectives:
        chosen = implementations(collective)
        if collective == "all_reduce" and extra:
            chosen.update(extra)
        for name, fn in chosen.items():
            if progress:
                progress(f"timing {name} on {lab.world_size} {plural(lab.world_size, 'rank')}")
            results += measure(lab, collective, name, fn, sizes, repeats)
    return results


def machine(lab: Any, sizes: Iterable[int | str] = ("4", "64K", "1M", "16M"), repeats: int = 5) -> dict:
    """α and β of one send/recv between ranks 0 and 1, and β of the local add, on this lab."""
    sizes = [parse_size(s) for s in sizes]
    if lab.world_size < 2:
        raise ConfigError("ddplab.bench.machine needs two ranks to send between; start a lab "
                         "with world_size=2 or more.")
    times = [lab.run(_pingpong_on_rank, m, repeats, ranks=[0, 1], timeout=600)[0] for m in sizes]
    fit = _fit_positive([[1.0, m] for m in sizes], times)
    add = lab.run(_add_on_rank, max(sizes), repeats, ranks=[0], timeout=600)[0]
    return {**fit, "beta_add": add / max(sizes),
            "pingpong": dict(zip(sizes, times))}


def _fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares on relative error (each row divided by its time): small sizes count too."""
    import numpy as np

    a = np.array(rows, dtype=float) / np.array(times)[:, None]
    coefficients, *_ = np.linalg.lstsq(a, np.ones(len(times)), rcond=None)
    return [float(c) for c in coefficients]


def fit_ring(results: list[Result], name: str = "ring") -> dict:
    """Fit T = 2(p-1)(α + (m/p)β) to ``name``'s all_reduce times, over every size and world size."""
    rows, times = [], []
    for r in results:
        if r.name == name and r.collective == "all_reduce" and r.world_size > 1:
            p = r.world_size
            rows.append([2 * (p - 1), 2 * (p - 1) * r.nbytes / p])
            times.append(r.seconds)
    if len(times) < 2:
        raise ConfigError(f"ddplab.bench.fit_ring needs {name!r} all_reduce times for at least two "
                         f"sizes on 2 or more ranks; run sweep() with more sizes first.")
    return _fit_positive(rows, times)


def _fit_positive(rows: list[list[float]], times: list[float]) -> dict:
    """α and β by ``_fit``; a noisy run can make one negative, then fit the other alone."""
    alpha, beta = _fit(rows, times)
    if alpha < 0:
        alpha, beta = 0.0, _fit([[row[1]] for row in rows], times)[0]
    elif beta < 0:
        alpha, beta = _fit([[row[0]] for row in rows], times)[0], 0.0
    return {"alpha": alpha, "beta": beta}


def table(results: list[Result]) -> str:
    """A text table, one line per measurement, like nccl-tests' output."""
    head = (f"{'collective':<11} {'ranks':>5}  {'implementation':<20} {'size':>8} "
            f"{'time':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.collective:<11} {r.world_size:>5}  {r.name:<20} {spell_size(r.nbytes):>8} "
                     f"{_spell_time(r.seconds):>10} {r.algbw / 1e9:>11.3f} {r.busbw / 1e9:>11.3f}")
    return "\n".join(lines)


def _spell_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def model_table(ring: dict, link: dict | None = None) -> str:
    """The fitted α, β next to what one send/recv and one add cost on this machine."""
    lines = [f"{'':<28} {'alpha':>10} {'beta':>12} {'1/beta':>12}"]

    def line(label, alpha, beta):
        alpha_text = "" if alpha is None else _spell_time(alpha)
        bandwidth = f"{1 / beta / 1e9:7.2f} GB/s" if beta > 0 else "  (noise)"
        lines.append(f"{label:<28} {alpha_text:>10} {beta * 1e9:>9.3f} ns/B {bandwidth}")

    line("ring fit, per step", ring["alpha"], ring["beta"])
    if link:
        line("send/recv, rank 0 -> 1", link["alpha"], link["beta"])
        line("local add a += b", None, link["beta_add"])
    return "\n".join(lines)


def plot(results: list[Result]):
    """Time and busbw against size, log-log: a row per collective, a colour per implementation,
    a line style per world size."""
    import matplotlib.pyplot as plt

    collectives = list(dict.fromkeys(r.collective for r in results))
    names = list(dict.fromkeys(r.name for r in results))
    world_sizes = sorted({r.world_size for r in results})
    styles = dict(zip(world_sizes, ["--", "-", ":", "-."] if len(world_sizes) > 1 else ["-"]))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # dpi 72: a notebook stores the picture, and this keeps it small.
    figure, axes = plt.subplots(len(collectives), 2, figsize=(10, 3.4 * len(collectives)),
                                dpi=72, squeeze=False)
    for row, collective in zip(axes, collectives):
        left, right = row
        for name in names:
            for world_size in world_sizes:
                points = sorted((r for r in results if (r.collective, r.name, r.world_size)
                                 == (collective, name, world_size)), key=lambda r: r.nbytes)
                if not points:
                    continue
                style = dict(linestyle=styles[world_size], marker="o", ms=3,
                             color=colours[names.index(name) % len(colours)],
                             label=f"{name}, {world_size} {plural(world_size, 'rank')}")
                x = [r.nbytes for r in points]
                left.plot(x, [r.seconds for r in points], **style)
                right.plot(x, [r.busbw / 1e9 for r in points], **style)
        for axis, ylabel in ((left, "time per call (s)"), (right, "busbw (GB/s)")):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("size (bytes)")
            axis.set_ylabel(ylabel)
            axis.set_title(collective)
            axis.grid(True, which="both", alpha=0.3)
        right.legend(fontsize=7)
    figure.tight_layout()
    return figure


# ------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddplab.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="e.g. 4K 1M 64M")
    parser.add_argument("--collectives", nargs="+", default=["all_reduce", "broadcast", "all_gather"],
                        choices=["all_reduce", "broadcast", "all_gather"])
    parser.add_argument("--repeats", type=int, default=5, help="repetitions; the best counts")
    parser.add_argument("--plot", metavar="PNG", help="also save the plots to this file")
    parser.add_argument("--backend", default="gloo", choices=["auto", "gloo", "nccl"],
                        help="the ranks' backend (nccl: one GPU per rank, CUDA tensors)")
    args = parser.parse_args(argv)

    from .lab.session import start

    results, link = [], None
    for world_size in args.world_sizes:
        lab = start(world_size=world_size, backend=args.backend, timeout=600)
        try:
            results += sweep(lab, args.collectives, args.sizes, args.repeats,
                             progress=lambda text: print(text, flush=True))
            if link is None and world_size >= 2:
                link = machine(lab, repeats=args.repeats)
        finally:
            lab.stop()
    print()
    print(table(results))
    _summary(results, link)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        plot(results).savefig(args.plot, dpi=120)
        print(f"plots saved to {args.plot}")
    return 0


def _summary(results: list[Result], link: dict | None) -> None:
    """The ring against gloo's own all_reduce at the largest common size, and the α-β fit."""
    by_key = {(r.name, r.world_size, r.nbytes): r for r in results if r.collective == "all_reduce"}
    common = sorted({(p, m) for (name, p, m) in by_key
                     if name == "ring" and p > 1 and ("dist.all_reduce", p, m) in by_key})
    if not common:
        # on 1 rank nothing crosses a link: busbw is 0 by definition, nothing to compare
        print("\n1 rank: no bus bandwidth to compare (nothing crosses a link); "
              "--world-sizes 2 or more for the ring against dist.all_reduce and the α-β fit")
        return
    target = [(p, m) for p, m in common if m == 16 << 20] or common[-1:]
    for p, m in target:
        ring, own = by_key[("ring", p, m)], by_key[("dist.all_reduce", p, m)]
        print(f"\nring vs dist.all_reduce at {spell_size(m)} on {p} {plural(p, 'rank')}: busbw "
              f"{ring.busbw / 1e9:.3f} vs {own.busbw / 1e9:.3f} GB/s, ratio {ring.busbw / own.busbw:.2f}")
    try:
        ring_fit = fit_ring(results)
    except ValueError:
        return
    print("\nalpha-beta model T = 2(p-1)(alpha + (m/p) beta), fitted to the ring's times:")
    print(model_table(ring_fit, link))
    print("(a shared machine: best of the repetitions, and still noisy)")


if __name__ == "__main__":
    raise SystemExit(main())
