"""lab.trace(): what the ranks' torch.distributed calls did, on real engines with gloo.

Time bounds are relative to what the ranks measured themselves (how long a
rank actually slept), never a bare number of seconds.
"""

from __future__ import annotations

import inspect
import json

import pytest
from conftest import side_lab

import ddplab
from ddplab.rank import trace as rank_trace

pytestmark = pytest.mark.slow

SLEEP = 1.0


def _installed_everywhere(lab) -> list:
    return lab.run(rank_trace.installed)


def _dispatcher_kernel_present() -> bool:
    import torch
    import torch.distributed
    return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "Autograd")


def _send_cell_is_torchs() -> bool:
    import torch.distributed as dist
    cell = dist.send.__closure__[dist.send.__code__.co_freevars.index("func")]
    return cell.cell_contents.__module__ == "torch.distributed.distributed_c10d"


def test_off_installs_nothing_and_stop_removes_everything(fresh_lab):
    # "Off" means off: no wrapper, no dispatcher kernel, torch's own functions in place.
    assert _installed_everywhere(fresh_lab) == [[], []]
    assert fresh_lab.run(_dispatcher_kernel_present) == [False, False]
    assert fresh_lab.run(_send_cell_is_torchs) == [True, True]
    with fresh_lab.trace():
        inside = _installed_everywhere(fresh_lab)
        assert fresh_lab.run(_dispatcher_kernel_present) == [True, True]
        assert fresh_lab.run(_send_cell_is_torchs) == [False, False]
    assert all("torch.distributed.send" in names and "torch.distributed.Work.wait" in names
               for names in inside)
    assert _installed_everywhere(fresh_lab) == [[], []]
    assert fresh_lab.run(_dispatcher_kernel_present) == [False, False]
    assert fresh_lab.run(_send_cell_is_torchs) == [True, True]


def _late_receiver(seconds):
    import time

    import torch
    import torch.distributed as dist
    t = torch.arange(4.0)
    dist.barrier()                     # both ranks start together
    if dist.get_rank() == 0:
        dist.send(t, dst=1)
        return 0.0
    began = time.perf_counter()
    time.sleep(seconds)
    slept = time.perf_counter() - began
    dist.recv(t, src=0)
    return slept


def _line_of(function, text: str) -> int:
    """The file's line number of the first line of ``function`` that holds ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_send_waits_about_as_long_as_the_receiver_slept(fresh_lab):
    with fresh_lab.trace() as tr:
        slept = fresh_lab.run(_late_receiver, SLEEP)[1]
    (send,), (recv,) = tr.find("send"), tr.find("recv")
    assert (send.rank, send.peer, recv.rank, recv.peer) == (0, 1, 1, 0)
    assert send.match == recv.index and recv.match == send.index
    assert send.nbytes == recv.nbytes == 16
    # A function given to lab.run: its name and line, as the live status and a hang say it.
    assert send.site == f"_late_receiver line {_line_of(_late_receiver, 'dist.send(')}"
    # The send spent the receiver's nap waiting, and the recv did not wait at all.
    assert abs(send.waited - slept) < 0.2 * slept, (send, slept)
    assert send.duration >= send.waited
    assert recv.waited < 0.1 * slept
    assert tr.events[0].start >= 0                 # seconds since the trace started


def _isend_then_wait(seconds):
    import time

    import torch
    import torch.distributed as dist
    t = torch.zeros(3)
    dist.barrier()
    if dist.get_rank() == 0:
        work = dist.isend(t, dst=1)
        work.wait()
        return 0.0
    began = time.perf_counter()
    time.sleep(seconds)
    slept = time.perf_counter() - began
    dist.irecv(t, src=0).wait()
    return slept


def test_isend_returns_at_once_and_its_wait_does_the_waiting(fresh_lab):
    with fresh_lab.trace() as tr:
        slept = fresh_lab.run(_isend_then_wait, SLEEP)[1]
    (isend,) = tr.find("isend")
    wait = next(e for e in tr.on(0) if e.op == "wait")
    assert wait.of == isend.index and not isend.blocking
    assert isend.duration < 0.1 * slept
    assert abs(wait.waited - slept) < 0.25 * slept
    (irecv,) = tr.find("irecv")
    assert isend.match == irecv.index and irecv.peer == 0
    assert "wait (isend to 1)" in tr.summary()


def _straggler(seconds):
    import time

    import torch
    import torch.distributed as dist
    dist.barrier()
    slept = 0.0
    if dist.get_rank() == 1:
        began = time.perf_counter()
        time.sleep(seconds)
        slept = time.perf_counter() - began
    dist.all_reduce(torch.ones(2))
    dist.barrier()
    return slept


def test_a_collective_waits_for_the_sleeping_straggler(fresh_lab):
    with fresh_lab.trace() as tr:
        slept = fresh_lab.run(_straggler, SLEEP)[1]
    fast, slow = tr.find("all_reduce", rank=0)[0], tr.find("all_reduce", rank=1)[0]
    assert abs(fast.waited - slept) < 0.2 * slept
    assert slow.waited < 0.1 * slept
    assert tr.straggler() == 1
    instance = next(i for i in tr.collectives() if i[0].op == "all_reduce")
    assert sorted(e.rank for e in instance) == [0, 1]


def _ddp_backward(steps, cap=0.2):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)),
                bucket_cap_mb=cap)
    for _ in range(steps):
        model(torch.randn(16, 64)).sum().backward()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_ddps_bucket_all_reduces_are_recorded_during_backward(fresh_lab):
    with fresh_lab.trace() as tr:
        param_bytes = fresh_lab.run(_ddp_backward, 2)[0]
    for rank in (0, 1):
        backwards = [c for c in tr.compute if c.rank == rank and c.op == "backward"]
        assert len(backwards) == 2
        last = backwards[-1]
        buckets = [e for e in tr.on(rank) if e.op == "all_reduce" and e.source == "torch"
                   and last.start <= e.start <= last.end]
        # Several buckets, issued while backward still ran, together all the gradients.
        assert len(buckets) >= 2
        assert sum(e.nbytes for e in buckets) == param_bytes
        assert all(e.done is not None and e.done >= e.start for e in buckets)
        assert buckets[0].start < last.end
        # DDP's constructor broadcast rank 0's weights: torch's own broadcasts, root 0.
        assert any(e.op == "broadcast" and e.source == "torch" and e.root == 0
                   for e in tr.on(rank))
    assert "all_reduce (" in tr.summary() and "by torch" in tr.summary()


def _mixed():
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    pair = dist.new_group([0, 1])
    t = torch.ones(5)
    dist.broadcast(t, src=0, group=pair)
    ops = [dist.P2POp(dist.isend, t, 1 - rank), dist.P2POp(dist.irecv, torch.zeros(5), 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return objects


def test_summary_is_identical_across_runs_and_names_every_op(fresh_lab):
    summaries = set()
    for _ in range(2):
        with fresh_lab.trace() as tr:
            fresh_lab.run(_mixed)
        summaries.add(repr(tr))
    assert len(summaries) == 1
    text = summaries.pop()
    for words in ("all_gather_object", "new_group", "broadcast from 0 (20 B, group 0,1)",
                  "isend to 1 (20 B)", "irecv from 0 (20 B)", "wait (all_reduce)"):
        assert words in text, (words, text)
    assert "rank 0:" in text and "rank 1:" in text
    (instance,) = [i for i in tr.collectives() if i[0].op == "broadcast"]
    assert {e.group for e in instance} == {(0, 1)}


def test_chrome_trace_json_has_the_trace_event_structure(fresh_lab, tmp_path):
    with fresh_lab.trace() as tr:
        fresh_lab.run(_late_receiver, 0.05)
        fresh_lab.run(_ddp_backward, 1)
    path = tr.save(str(tmp_path / "trace.json"))
    data = json.loads(open(path).read())
    assert set(data) >= {"traceEvents", "displayTimeUnit"}
    phases = {"X", "M", "s", "f"}
    names = {}
    for item in data["traceEvents"]:
        assert item["ph"] in phases and isinstance(item["pid"], int) and isinstance(item["tid"], int)
        if item["ph"] == "M":
            names[(item["pid"], item["name"])] = item["args"]["name"] if "name" in item["args"] \
                else item["args"]
            continue
        assert isinstance(item["ts"], (int, float)) and isinstance(item["name"], str)
        if item["ph"] == "X":
            assert item["dur"] >= 0 and isinstance(item["args"], dict)
    assert names[(0, "process_name")] == "rank 0" and names[(1, "process_name")] == "rank 1"
    flows = [i for i in data["traceEvents"] if i["ph"] in "sf"]
    starts = {i["id"] for i in flows if i["ph"] == "s"}
    assert starts and starts == {i["id"] for i in flows if i["ph"] == "f"}
    spans = [i for i in data["traceEvents"] if i["ph"] == "X"]
    assert {"send", "recv", "all_reduce", "backward"} <= {i["name"] for i in spans}


def test_the_picture_has_a_lane_per_rank_arrows_hatching_and_hover(fresh_lab):
    with fresh_lab.trace() as tr:
        fresh_lab.run(_late_receiver, 0.2)
        fresh_lab.run(_straggler, 0.2)
    page = tr._repr_html_()
    assert page.startswith("<!-- ddplab-trace -->") and page.endswith("<!-- /ddplab-trace -->")
    assert page.index(">rank 0<") < page.index(">rank 1<")
    assert 'marker-end="url(#ddplab-arrow)"' in page          # send -> recv
    assert 'fill="url(#ddplab-wait)"' in page                  # waiting, hatched
    assert "<title>rank 0: send to 1 (16 B)" in page and "waiting for another rank" in page
    from ddplab.grade.compare import sanitize, sanitize_patterns
    assert sanitize(page, sanitize_patterns()) == "<!-- ddplab-trace -->"


def test_a_failing_cell_still_stops_the_trace(fresh_lab):
    with pytest.raises(ddplab.RankError):
        with fresh_lab.trace() as tr:
            fresh_lab.run_cell("dist.barrier()\nif rank == 1:\n    raise ValueError('no')")
    assert tr.find("barrier") and tr.find("barrier")[0].site == "cell line 1"
    assert _installed_everywhere(fresh_lab) == [[], []]


def test_one_trace_at_a_time(fresh_lab):
    with fresh_lab.trace():
        with pytest.raises(ddplab.DdplabError, match="already recording"):
            fresh_lab.trace().start()
    with fresh_lab.trace() as tr:             # the refused one left nothing behind
        fresh_lab.run_cell("dist.barrier()")
    assert len(tr.find("barrier")) == 2


def test_clock_offsets_measured_by_round_trips_are_within_their_bound(fresh_lab):
    # Ranks on this machine share its clock, so the measured offset must be 0 within the error.
    with fresh_lab.trace(align="ping") as tr:
        pass
    for clock in tr.clock.values():
        assert clock.how.startswith("round trips") and clock.error > 0
        assert abs(clock.offset) <= clock.error
    with fresh_lab.trace() as tr:
        pass
    assert {c.how for c in tr.clock.values()} == {"same machine"}


def test_ranks_trace_magic_shows_the_picture_under_the_cell(shell, fresh_lab, capsys):
    from ddplab import trace as tracing
    result = shell.run_cell("%%ranks --trace\nt = torch.ones(2) * rank\ndist.all_reduce(t)\nprint(t)")
    assert result.error_in_exec is None
    out = capsys.readouterr().out
    assert out.index("[rank 1]") < out.index("trace of ranks 0, 1: 2 operations")
    assert "rank 0: all_reduce (8 B)" in out
    assert tracing.last().find("all_reduce")[0].site == "cell line 2"
    result = shell.run_cell("%%ranks --trace kept\ndist.barrier()")
    assert result.error_in_exec is None and capsys.readouterr().out
    assert shell.user_ns["kept"] is tracing.last() and len(shell.user_ns["kept"].events) == 2
    result = shell.run_cell("%%rank 1 --trace\ny = rank + 1")
    assert result.error_in_exec is None
    assert "trace of rank 1: 0 operations\nrank 1: (nothing)" in capsys.readouterr().out


def test_summary_folds_repeats():
    from ddplab.trace.picture import compress, size
    assert compress(["a", "a", "a", "b"]) == ["a ×3", "b"]
    assert compress(["a", "b"] * 6 + ["c"]) == ["(a, b) ×6", "c"]
    assert compress(["x"]) == ["x"] and compress([]) == []
    assert [size(n) for n in (16, 999, 8440, 4_448_040)] == ["16 B", "999 B", "8.44 kB", "4.45 MB"]


def _barrier_then_pair():
    import torch
    import torch.distributed as dist
    dist.barrier()
    t = torch.ones(3)
    (dist.isend(t, 1) if dist.get_rank() == 0 else dist.irecv(t, 0)).wait()


def test_zoom_after_the_barrier_draws_only_what_follows(fresh_lab):
    with fresh_lab.trace() as tr:
        fresh_lab.run(_barrier_then_pair)
    view = tr.zoom(after="barrier")
    assert "barrier" not in repr(view) and "isend to 1 (12 B)" in repr(view)
    assert "barrier" in repr(tr)
    assert view._repr_html_().count("<title>rank") < tr._repr_html_().count("<title>rank")
    with pytest.raises(ddplab.ConfigError, match="no 'all_reduce'"):
        tr.zoom(after="all_reduce")


def test_summary_lines_break_between_ops_never_inside_one():
    from ddplab.trace import Event, Trace
    from ddplab.trace.picture import summary

    trace = Trace.__new__(Trace)
    trace.ranks, trace.complete, trace.compute = [0], True, []
    trace.events = [Event(index=i, rank=0, op="all_reduce", kind="collective", start=i, end=i,
                          nbytes=1000 * (i + 1), source="torch") for i in range(12)]
    text = summary(trace, width=60)
    lines = text.splitlines()
    assert lines[1].startswith("rank 0: all_reduce (1 kB, by torch),")
    assert all(len(line) <= 60 for line in lines[1:]), text
    assert all(line.rstrip().endswith(("torch),", "torch)")) for line in lines[1:]), text


def test_a_bare_lab_traces_the_students_own_init_process_group():
    lab = side_lab(2, timeout=30, grace=1.0, init_method=None)
    try:
        with lab.trace() as tr:
            lab.run_cell("import torch.distributed as dist\n"
                         "dist.init_process_group('gloo', init_method=f'file://{lab_dir}/init', "
                         "rank=rank, world_size=2)\ndist.barrier()")
        assert repr(tr).splitlines()[1:] == ["rank 0: init_process_group, barrier",
                                             "rank 1: init_process_group, barrier"]
        assert tr.find("init_process_group", rank=1)[0].site == "cell line 2"
    finally:
        lab.stop()


def _one_rank_skips_the_last_all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(3)
    for _ in range(3):
        dist.all_reduce(t)
    if dist.get_rank() == 0:
        dist.all_reduce(t)             # rank 1 never calls it: rank 0 is stuck here


def test_a_hang_inside_a_trace_keeps_what_was_recorded(fresh_lab):
    with pytest.raises(ddplab.HangError):
        with fresh_lab.trace() as tr:
            fresh_lab.run(_one_rank_skips_the_last_all_reduce, timeout=3)
    assert tr.events is not None and tr.hung and not tr.running
    assert [len(tr.find("all_reduce", rank=r)) for r in (0, 1)] == [4, 3]
    stuck = [e for e in tr.events if e.open]
    assert [(e.rank, e.op) for e in stuck] == [(0, "all_reduce")]
    assert stuck[0].site and "_one_rank_skips_the_last_all_reduce" in stuck[0].site
    assert all(not e.open for e in tr.find("all_reduce", rank=1))
    assert "up to a hang" in repr(tr) and "stuck in it" in repr(tr)
    assert "stuck →" in tr._repr_html_()
    assert ddplab.trace.last() is tr
    fresh_lab.restart()


def _synthetic_trace(n: int):
    """A Trace of ``n`` small all_reduces per rank, as ``stop`` would build it (no ranks)."""
    from ddplab.trace import Clock, Trace
    tr = Trace.__new__(Trace)
    tr.ranks, tr.t0, tr.clock, tr.running, tr.complete, tr.hung = [0, 1], 0.0, {}, False, True, False
    tr.clock = {0: Clock(), 1: Clock()}
    results = {}
    for rank in (0, 1):
        events = [{"op": "all_reduce", "kind": "collective", "start": i * 1e-4 + rank * 1e-5,
                   "end": i * 1e-4 + 5e-5, "nbytes": 4, "group": None, "source": "call",
                   "blocking": True, "site": "cell line 2"} for i in range(n)]
        results[rank] = {"events": events, "compute": [], "recorded": True}
    tr._build(results)
    return tr


def test_the_picture_of_a_100k_event_trace_is_aggregated_into_bins():
    from ddplab.trace import picture as timeline
    tr = _synthetic_trace(50_000)              # 2 ranks: 100k events
    assert len(tr.events) == 100_000
    page = tr._repr_html_()
    bins = page.count(f'width="{timeline.BIN_PX}" height="{timeline.ROW}"')
    lanes = (timeline.WIDTH - timeline.LEFT - timeline.RIGHT) // timeline.BIN_PX
    assert 0 < bins <= 2 * lanes                 # at most one box per bin per rank, not 100k
    assert "100000 operations" in page and "all_reduce ×" in page
    assert "waiting for another rank" in page    # the waits are still counted per bin
    small = _synthetic_trace(10)                 # a small trace keeps a box per op
    assert small._repr_html_().count("<title>rank ") >= 20


def test_columns_as_ranks_send_them_give_the_events_rows_give():
    """What a rank's ``stop`` sends (a list per field, a constant one packed, through JSON
    after a hang) is read into the same Events as a list of dicts, the older form."""
    from ddplab.rank.recorder import COLUMNS, packed
    rows = [{"op": "send", "kind": "p2p", "start": 1.0, "end": 2.0, "nbytes": 16, "peer": 1,
             "group": (0, 1), "site": "cell line 2"},
            {"op": "isend", "kind": "p2p", "start": 2.5, "end": 2.6, "nbytes": 16, "peer": 1,
             "group": (0, 1), "blocking": False, "done": 3.0, "site": "cell line 3"},
            {"op": "wait", "kind": "wait", "start": 2.7, "end": 3.0, "of": 1, "group": (0, 1),
             "site": "cell line 4"}]
    peer_rows = [dict(r, peer=0, op=r["op"].replace("send", "recv"), start=r["start"] + 0.5)
                 for r in rows]
    as_rows = _built({0: rows, 1: peer_rows})
    columns = {rank: json.loads(json.dumps({key: packed([r.get(key, default) for r in these])
                                            for key, default in COLUMNS.items()}))
               for rank, these in ((0, rows), (1, peer_rows))}
    assert isinstance(columns[0]["group"], dict)               # one value for every row
    as_columns = _built(columns)
    assert as_columns.events == as_rows.events
    assert [e.match for e in as_columns.events] == [3, 4, None, 0, 1, None]
    assert as_columns.events[0].waited == 0.5 and as_columns.events[2].of == 1
    assert as_columns.columns()["op"] == [e.op for e in as_rows.events]
    assert repr(as_columns) == repr(as_rows)


def _built(events: dict):
    from ddplab.trace import Clock, Trace
    tr = Trace.__new__(Trace)
    tr.ranks, tr.t0, tr.running, tr.complete, tr.hung = [0, 1], 0.0, False, True, False
    tr.clock = {0: Clock(), 1: Clock()}
    tr._build({rank: {"events": these, "compute": [], "recorded": True}
               for rank, these in events.items()})
    return tr
