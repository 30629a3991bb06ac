"""What ``lab.trace()`` costs: per traced call, and on notebook 05's training step.

1. Off costs nothing. Outside a trace no wrapper and no dispatcher kernel is
   installed on any rank (``ddplab.rank.trace.installed()`` is empty, the
   c10d ops have no Autograd kernel, ``dist.send`` calls torch's own
   function): checked here before and after tracing, so "off" runs exactly
   torch's code.
2. Per call: a 2-rank gloo lab times N calls of each op on the ranks, with
   tracing off and on, alternating; the difference is the cost of recording.
   "DDP step" is a forward+backward of a small DDP model, whose bucket
   all_reduce goes through the recording dispatcher kernel.
3. Training: ``ddplab.train.train`` (notebook 05's loop) through ``lab.run``,
   training samples/s as ``train`` measures it, off and on alternating,
   ``--repeat`` times, each traced run against the off runs either side of it (the
   machine's load changes between runs); also the CPU seconds of each rank's main
   thread, steadier under load. Goal: under 5 % slower. ``--alternatives`` also runs it
   under ``torch.profiler`` (CPU activity), the other way to see DDP's
   all_reduces, for comparison.

4. At scale (``--scale 100000``): that many small all_reduces in one ``lab.run``, untraced
   and traced, alternating (off, traced, off, ..., off; ``--repeat`` traced runs), each
   traced run against the mean of the untraced runs either side of it, so a drift of
   the machine's load cancels out; medians of those paired ratios. Wall and CPU, of the
   loop on the ranks and of the whole call the user waits for (trace start, run, stop
   with collecting). Goal: the whole call under 1.5x untraced, wall. Also the seconds to
   draw the picture of that trace (goal: under 2 s, whatever the size), to make
   ``tr.events``, and to display it as a notebook does (HTML and text). The load average
   is printed at the start and the end. ``--only-scale`` runs just this part.

Run: ``.venv/bin/python benchmarks/bench_trace.py [--repeat 9] [--epochs 4] [--calls 300] [--alternatives]
[--scale 100000] [--only-scale]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time

from ddplab import train
from ddplab.lab import Lab, LabSpec
from ddplab.rank import trace as rank_trace


def per_call(op: str, n: int) -> tuple[float, float]:
    """On a rank: (wall seconds, CPU seconds of this thread) per call of ``op``, over ``n`` calls."""
    import torch
    import torch.distributed as dist
    rank, t = dist.get_rank(), torch.ones(1)
    model = None
    if op == "DDP step":
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(32, 32))
        x = torch.randn(8, 32)
        model(x).sum().backward()
    dist.barrier()
    began, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        if op == "all_reduce":
            dist.all_reduce(t)
        elif op == "send/recv":
            dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        elif op == "isend/irecv + wait":
            (dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)).wait()
        elif op == "DDP step":
            model(x).sum().backward()
    return (time.perf_counter() - began) / n, (time.thread_time() - cpu) / n


def _scale_run(lab: Lab, calls: int, traced: bool) -> dict:
    """One run of ``calls`` all_reduces, traced or not: wall and CPU seconds of the loop on
    the ranks (slowest rank, its main thread) and of the whole call as the user waits for
    it (trace start, run, stop with collecting); CPU of the whole call is the busiest
    rank's process plus this kernel's."""
    rank_cpu, kernel_cpu = lab.run(time.process_time), time.process_time()
    began = time.perf_counter()
    trace = lab.trace().start() if traced else None
    per = lab.run(per_call, "all_reduce", calls, timeout=900)
    collect = time.perf_counter()
    if trace is not None:
        trace.stop()
    end = time.perf_counter()
    kernel_cpu = time.process_time() - kernel_cpu
    rank_cpu = max(after - before for after, before in zip(lab.run(time.process_time), rank_cpu))
    return {"loop": max(r[0] for r in per) * calls, "loop_cpu": max(r[1] for r in per) * calls,
            "whole": end - began, "whole_cpu": rank_cpu + kernel_cpu, "collect": end - collect,
            "trace": trace}


def at_scale(lab: Lab, calls: int, repeat: int) -> bool:
    """Part 4: ``calls`` small all_reduces traced against untraced, and the picture's time.

    Runs alternate off, traced, off, ..., off; each traced run is divided by the mean of
    the off runs either side of it (the machine's load drifts between runs), and the
    medians of those ratios are reported, wall and CPU. True if the goals are met.
    """
    load = os.getloadavg()[0]
    runs = [_scale_run(lab, calls, False)]
    ratios: dict[str, list] = {k: [] for k in ("loop", "loop_cpu", "whole", "whole_cpu")}
    traced: list[dict] = []
    for _ in range(repeat):
        on, off = _scale_run(lab, calls, True), _scale_run(lab, calls, False)
        for key in ratios:
            ratios[key].append(on[key] / ((runs[-1][key] + off[key]) / 2))
        traced.append(on)
        runs.append(off)
        draw = _picture(on.pop("trace"))
        on.update(draw)
    def median(rows, key):
        return statistics.median(r[key] for r in rows)
    ratio = {key: statistics.median(values) for key, values in ratios.items()}
    print(f"\nat scale: {calls} all_reduces of 4 B per rank; {repeat} traced runs, each against "
          f"the untraced runs either side of it; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; medians:")
    print(f"  {'':<36} {'off':>8} {'traced':>8} {'paired':>8}")
    for key, words in (("loop", "loop on the ranks, wall s"), ("loop_cpu", "loop on the ranks, CPU s"),
                       ("whole", "whole call, wall s"), ("whole_cpu", "whole call, CPU s")):
        print(f"  {words:<36} {median(runs, key):8.2f} {median(traced, key):8.2f} "
              f"{ratio[key]:7.2f}x")
    print(f"  collecting the trace after the run (stop): {median(traced, 'collect'):.2f} s")
    print(f"  picture of the {traced[-1]['events']}-event trace: HTML {median(traced, 'html'):.2f} s; "
          f"displayed as a notebook does (HTML and text) {median(traced, 'display'):.2f} s; "
          f"tr.events first read after that {median(traced, 'events_s'):.2f} s")
    met = ratio["whole"] < 1.5, median(traced, "html") < 2
    print(f"goal: whole call under 1.5x untraced, wall: {ratio['whole']:.2f}x "
          f"({'met' if met[0] else 'NOT met'}; CPU {ratio['whole_cpu']:.2f}x); picture under 2 s: "
          f"{'met' if met[1] else 'NOT met'}", flush=True)
    return all(met)


def _picture(trace) -> dict:
    """Seconds to draw the picture (HTML); to display the trace as a notebook does (HTML
    and text); and to make ``tr.events`` at its first read, after those (where the
    picture needed no Events; ddplab before 2026-11-25 made them in ``stop``)."""
    from IPython.core.formatters import DisplayFormatter
    began = time.perf_counter()
    trace._repr_html_()
    html = time.perf_counter() - began
    began = time.perf_counter()
    DisplayFormatter().format(trace)
    display = time.perf_counter() - began
    began = time.perf_counter()
    events = len(trace.events)
    return {"html": html, "display": display, "events_s": time.perf_counter() - began,
            "events": events}


def nothing_installed(lab: Lab) -> bool:
    def check() -> bool:
        import torch
        import torch.distributed as dist
        cell = dist.send.__closure__[dist.send.__code__.co_freevars.index("func")]
        return (not rank_trace.installed()
                and not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "Autograd")
                and cell.cell_contents.__module__ == "torch.distributed.distributed_c10d")
    return all(lab.run(check))


def timed_train(config: train.Config, profiler: bool = False) -> dict:
    """On a rank: train, and add the CPU seconds this thread spent in it (steady under load)."""
    began = time.thread_time()
    if profiler:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]):
            result = train.train(config)
    else:
        result = train.train(config)
    return {"samples_per_s": result["samples_per_s"], "cpu_s": time.thread_time() - began}


def run_training(lab: Lab, config: train.Config, mode: str) -> tuple[float, float, float, int]:
    """(samples/s, CPU s of the busiest rank, seconds to collect the trace, events recorded)."""
    with contextlib.redirect_stdout(io.StringIO()):
        trace = lab.trace().start() if mode == "traced" else None
        results = lab.run(timed_train, config, mode == "torch.profiler", timeout=900)
        began = time.perf_counter()
        if trace is not None:
            trace.stop()
    return (statistics.median(r["samples_per_s"] for r in results),
            max(r["cpu_s"] for r in results), time.perf_counter() - began,
            len(trace.events) if trace is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--alternatives", action="store_true",
                        help="also time training under torch.profiler")
    parser.add_argument("--scale", type=int, default=100_000)
    parser.add_argument("--only-scale", action="store_true")
    args = parser.parse_args()
    print(f"2 ranks, gloo on CPU; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f} at the start; medians of {args.repeat}.", flush=True)
    lab = Lab(LabSpec(world_size=2, backend="gloo", timeout=900, grace=2.0, pg_timeout=1800,
                      debug=False), gpus=0)
    lab.start()
    try:
        assert nothing_installed(lab), "something is installed before any trace"
        if args.only_scale:
            at_scale(lab, args.scale, args.repeat)
            return
        print("\nper call, µs (slowest rank; wall clock, and CPU time of the calling thread):")
        print(f"  {'op':<20} {'wall off':>9} {'traced':>8} {'cost':>7}   {'CPU off':>8} "
              f"{'traced':>8} {'cost':>7}")
        for op in ("all_reduce", "send/recv", "isend/irecv + wait", "DDP step"):
            off, on = [], []
            for _ in range(args.repeat):
                off.append(lab.run(per_call, op, args.calls))
                with lab.trace():
                    on.append(lab.run(per_call, op, args.calls))
            wall = [statistics.median(max(r[0] for r in x) for x in runs) * 1e6 for runs in (off, on)]
            used = [statistics.median(max(r[1] for r in x) for x in runs) * 1e6 for runs in (off, on)]
            print(f"  {op:<20} {wall[0]:9.1f} {wall[1]:8.1f} {wall[1] - wall[0]:+7.1f}   "
                  f"{used[0]:8.1f} {used[1]:8.1f} {used[1] - used[0]:+7.1f}", flush=True)
        assert nothing_installed(lab), "a trace left something installed"
        print("  off, before and after tracing: nothing installed on any rank (checked)")

        config = train.Config(epochs=args.epochs, verbose=False)
        run_training(lab, train.Config(epochs=1, verbose=False), "off")        # warm up
        # off, traced, off, traced, ..., off: each traced run is compared with the mean of
        # the off runs either side of it, so a change of load between runs cancels out.
        modes = ["traced"] + (["torch.profiler"] if args.alternatives else [])
        speed = {m: [] for m in ["off"] + modes}
        cpu = {m: [] for m in ["off"] + modes}
        ratio = {m: [] for m in modes}
        cpu_ratio = {m: [] for m in modes}
        collect, events = [], 0
        last = run_training(lab, config, "off")
        speed["off"].append(last[0])
        cpu["off"].append(last[1])
        for _ in range(args.repeat):
            for mode in modes:
                a, b, c, n = run_training(lab, config, mode)
                after = run_training(lab, config, "off")
                speed[mode].append(a)
                cpu[mode].append(b)
                speed["off"].append(after[0])
                cpu["off"].append(after[1])
                ratio[mode].append(a / ((last[0] + after[0]) / 2))
                cpu_ratio[mode].append(b / ((last[1] + after[1]) / 2))
                last = after
                if mode == "traced":
                    collect.append(c)
                    events = n
        print(f"\nnotebook 05's training (ddplab.train, {args.epochs} epochs), {args.repeat} runs "
              f"each, every one against the off runs either side of it:")
        print(f"  {'':<15} {'samples/s':>10} {'x off (paired)':>15} {'CPU s':>7} {'CPU cost':>9}")
        print(f"  {'off':<15} {statistics.median(speed['off']):10.0f} {1:15.3f} "
              f"{statistics.median(cpu['off']):7.2f} {0:+8.1f}%")
        for mode in modes:
            r, c = statistics.median(ratio[mode]), statistics.median(cpu_ratio[mode])
            print(f"  {mode:<15} {statistics.median(speed[mode]):10.0f} {r:15.3f} "
                  f"{statistics.median(cpu[mode]):7.2f} {(c - 1) * 100:+8.1f}%", flush=True)
        print(f"  trace of one run: {events} events, collected in "
              f"{statistics.median(collect):.2f} s after the run")
        slower = 1 - statistics.median(ratio["traced"])
        extra_cpu = statistics.median(cpu_ratio["traced"]) - 1
        at_scale(lab, args.scale, args.repeat)
        print(f"\ngoal: under 5 % slower with tracing on: samples/s {slower * 100:+.1f} %, CPU "
              f"{extra_cpu * 100:+.1f} %: {'met' if max(slower, extra_cpu) < 0.05 else 'NOT met'}")
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
