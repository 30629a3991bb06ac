"""ddplab.launch: torchrun and mp.spawn as subprocesses, output by rank, nothing left behind."""

from __future__ import annotations

import os
import tempfile
import textwrap
import time

import pytest
from conftest import alive, my_process_tree

import ddplab
from ddplab import launch
from ddplab.text import replace_tracebacks

pytestmark = pytest.mark.slow

# Several labs share two cores while the tests run: generous, never tight.
TIMEOUT = 240

ENV_SCRIPT = """
import os
import torch
import torch.distributed as dist
from ddplab.launch import report_env

dist.init_process_group("gloo")        # env://, from what torchrun set
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"hello from rank {dist.get_rank()}, sum {t.item():g}")
report_env(pid=os.getpid(), total=t.item())
dist.destroy_process_group()
"""

SPAWN_SCRIPT = """
import os
import sys
import torch.distributed as dist
import torch.multiprocessing as mp
from ddplab.launch import report_env

def worker(index, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=index, world_size=world_size)
    print(f"[rank {index}] first line, port {port}")
    report_env(pid=os.getpid(), index=index)
    if FAIL and index == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()
    print(f"[rank {index}] second line")
    dist.destroy_process_group()

if __name__ == "__main__":
    world_size, port = int(sys.argv[1]), sys.argv[2]
    mp.spawn(worker, args=(world_size, port), nprocs=world_size)
"""

HANG_SCRIPT = """
import os
import time
import torch.distributed as dist
from ddplab.launch import report_env


dist.init_process_group("gloo")
report_env(pid=os.getpid())
if dist.get_rank() == 0:
    time.sleep(3600)                   # never reaches the barrier rank 1 waits in
dist.barrier()
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def nothing_left(monkeypatch):
    """Fails the test if a launch leaves a process or its folder behind."""
    # Note the folders this test's launches make: other launches on this
    # machine (a notebook running meanwhile) make and remove their own.
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    before = my_process_tree()
    yield
    assert my_process_tree() <= before
    assert not [folder for folder in made if os.path.exists(folder)]


def assert_gone(result):
    """The launched ranks themselves are gone (torchrun's workers are not our descendants once
    torchrun is gone, so my_process_tree alone would not see them)."""
    pids = [report["pid"] for report in result.reports.values()]
    assert pids and not [pid for pid in pids if alive(pid)]


def test_torchrun_one_node(tmp_path, nothing_left):
    result = launch.torchrun(write(tmp_path, "env.py", ENV_SCRIPT), nproc_per_node=2, timeout=TIMEOUT)
    assert result.ok and result.returncodes == [0]
    assert result.output_by_rank() == ("[rank 0]\nhello from rank 0, sum 1\n"
                                       "[rank 1]\nhello from rank 1, sum 1")
    for rank, report in result.reports.items():
        assert report["RANK"] == report["LOCAL_RANK"] == str(rank)
        assert report["WORLD_SIZE"] == report["LOCAL_WORLD_SIZE"] == "2"
        assert report["MASTER_ADDR"] == "127.0.0.1" and report["MASTER_PORT"].isdigit()
    assert "PORT" in launch.command_line(result)
    port = result.reports[0]["MASTER_PORT"]
    assert port not in launch.command_line(result) and port not in result.env_table()
    assert "MASTER_PORT            PORT       PORT" in result.env_table()
    assert_gone(result)


def test_torchrun_two_nodes_form_one_group(tmp_path, nothing_left):
    result = launch.torchrun(write(tmp_path, "env.py", ENV_SCRIPT), nproc_per_node=1, nnodes=2,
                             timeout=TIMEOUT)
    assert len(result.commands) == 2 and result.returncodes == [0, 0]
    assert sorted(result.reports) == [0, 1]
    for rank, report in result.reports.items():
        node, local = int(report["GROUP_RANK"]), int(report["LOCAL_RANK"])
        assert rank == int(report["RANK"]) == node * 1 + local
        assert report["WORLD_SIZE"] == "2" and report["total"] == 1.0
    assert "--node_rank 1" in launch.command_line(result, 1)
    assert_gone(result)


def test_spawn_groups_prefixed_lines_by_rank(tmp_path, nothing_left):
    result = launch.spawn(write(tmp_path, "spawn.py", "FAIL = False\n" + SPAWN_SCRIPT), nprocs=2,
                          timeout=TIMEOUT)
    assert result.rank_output == {0: "first line, port PORT\nsecond line\n",
                                  1: "first line, port PORT\nsecond line\n"}
    for rank, report in result.reports.items():
        # mp.spawn sets none of torchrun's variables: the rank is an argument.
        assert report["RANK"] is None and report["index"] == rank == report["dist.get_rank()"]
    assert_gone(result)


SPAWN_NODES_SCRIPT = """
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from ddplab.launch import report_env

def worker(local_rank, node_rank, nnodes, nprocs, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    rank = node_rank * nprocs + local_rank
    dist.init_process_group("gloo", rank=rank, world_size=nnodes * nprocs)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"[rank {rank}] node {node_rank}, index {local_rank}, sum {total.item():g}")
    report_env(pid=os.getpid(), node=node_rank, index=local_rank)
    dist.destroy_process_group()

if __name__ == "__main__":
    nprocs, port, node_rank, nnodes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    mp.spawn(worker, args=(int(node_rank), int(nnodes), int(nprocs), port), nprocs=int(nprocs))
"""


def test_spawn_on_two_simulated_nodes_forms_one_group(tmp_path, nothing_left):
    result = launch.spawn(write(tmp_path, "spawn_nodes.py", SPAWN_NODES_SCRIPT), nprocs=2, nnodes=2,
                          timeout=TIMEOUT)
    assert result.rank_output == {rank: f"node {rank // 2}, index {rank % 2}, sum 6\n"
                                  for rank in range(4)}
    assert sorted(result.reports) == [0, 1, 2, 3]
    assert [launch.command_line(result, i).split()[2:] for i in (0, 1)] == \
        [["2", "PORT", "0", "2"], ["2", "PORT", "1", "2"]]
    assert_gone(result)


def test_failing_launch_raises_with_the_ranks_output_and_leaves_nothing(tmp_path, nothing_left):
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(write(tmp_path, "spawn.py", "FAIL = True\n" + SPAWN_SCRIPT), nprocs=2,
                     timeout=TIMEOUT)
    message = str(info.value)
    assert message.startswith("ddplab: the launch failed")
    assert "ValueError: rank one cannot go on" in message
    assert "Fix the error shown above" in message
    assert not info.value.launch.ok
    assert_gone(info.value.launch)


def test_hanging_launch_is_ended_after_a_timeout_without_progress(tmp_path, nothing_left):
    # The workers' start (torch's import, the rendezvous) uses the CPU: progress, however long
    # it takes on 2 busy cores. Then rank 0 sleeps an hour and rank 1 waits in the barrier:
    # no output, no CPU, and the launch ends a whole timeout later.
    begin = time.monotonic()
    with pytest.raises(launch.LaunchError, match=r"made no progress for timeout=5 s \(no output, "
                                                 r"no CPU time used\); every process it started "
                                                 r"was ended") as info:
        launch.torchrun(write(tmp_path, "hang.py", HANG_SCRIPT), nproc_per_node=2, timeout=5)
    assert time.monotonic() - begin >= 5
    result = info.value.launch
    assert result.timed_out and result.returncodes == [None]
    assert sorted(result.reports) == [0, 1]     # both workers were really running
    # ddplab's own SIGTERM is said in one line, not by torch's SignalException traceback
    assert ("ddplab ended this launcher with SIGTERM: no progress for timeout=5 s (torch's traceback for "
            "it left out)") in result.launcher_output, result.launcher_output
    assert "SignalException" not in str(info.value) and "Traceback" not in result.launcher_output
    assert_gone(result)


def test_only_the_named_tracebacks_are_replaced():
    text = ("before\nTraceback (most recent call last):\n  File \"run.py\", line 1, in <module>\n"
            "    main()\nSignalX: Process 7 got signal: 15\nbetween\n"
            "Traceback (most recent call last):\n  File \"a.py\", line 2\nValueError: kept\n")
    assert replace_tracebacks(text, "SignalX:", "one line") == (
        "before\none line\nbetween\nTraceback (most recent call last):\n  File \"a.py\", line 2\n"
        "ValueError: kept\n")


@pytest.mark.parametrize("call,words", [
    (lambda: launch.torchrun("x.py", nnodes=0), "nnodes must be a whole number of nodes"),
    (lambda: launch.torchrun("x.py", nproc_per_node=1.5), "nproc_per_node must be a whole number"),
    (lambda: launch.spawn("x.py", nprocs=0), "nprocs must be a whole number of processes"),
    (lambda: launch.spawn("x.py", nprocs=2, timeout=-1), "timeout must be a positive"),
])
def test_bad_arguments_are_config_errors(call, words, nothing_left):
    with pytest.raises(ddplab.ConfigError, match=words):
        call()


def test_env_table_reads_reports_by_rank():
    table = launch.env_table([{"RANK": "0", "MASTER_PORT": "4242"}, {"RANK": "1"}],
                             names=("RANK", "MASTER_PORT"))
    assert table.splitlines() == ["variable     rank 0  rank 1",
                                  "RANK         0       1",
                                  "MASTER_PORT  PORT    -"]


def test_rank_lines_survive_two_ranks_printing_at_once():
    # Unbuffered print writes text and newline separately; ranks interleave between them.
    text = "[rank 1] b1[rank 0] a1\n\nnoise\n[rank 0] a2\n[rank 1] b2\n"
    assert launch._rank_lines(text) == {0: "a1\na2\n", 1: "b1\nb2\n"}


#: Rank 0 waits in a barrier; rank 1 computes for ever (WAIT) or leaves at once (LEAVE).
UNEVEN_SCRIPT = """
import os
import torch.distributed as dist
from ddplab.launch import report_env

dist.init_process_group("gloo")
report_env(pid=os.getpid())
if dist.get_rank() == 0:
    dist.barrier()                     # rank 1 never calls it
elif WAIT:
    while True:
        pass
"""


def test_a_launch_whose_rank_waits_while_another_computes_is_ended_naming_it(tmp_path, nothing_left):
    # The CPU rank 1 uses is progress, for ever: the wait of rank 0 is the hang all the same.
    begin = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(write(tmp_path, "uneven.py", "WAIT = True\n" + UNEVEN_SCRIPT),
                        nproc_per_node=2, timeout=5)
    took = time.monotonic() - begin
    message = str(info.value)
    assert message.startswith(
        "ddplab: rank 0 in barrier (uneven.py line 10): it has waited in that torch.distributed "
        "call for timeout=5 s without it finishing, and that wait is the hang, whatever the "
        "other ranks do meanwhile"), message
    assert info.value.launch.waited == {0: "in barrier (uneven.py line 10)"}
    assert took < TIMEOUT                      # it ended; before, never (rank 1 computes)
    assert_gone(info.value.launch)


def test_a_launch_whose_rank_leaves_while_another_waits_names_it(tmp_path, nothing_left):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(write(tmp_path, "uneven.py", "WAIT = False\n" + UNEVEN_SCRIPT),
                        nproc_per_node=2, timeout=TIMEOUT)
    message = str(info.value)
    assert message.startswith(
        "ddplab: rank 0 waited in barrier (uneven.py line 10) for rank 1, which finished "
        "without making that call: when its process group closed, gloo ended the wait with "
        "\"Connection closed by peer\" (no rank crashed)."), message
    assert_gone(info.value.launch)
