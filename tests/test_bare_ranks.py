"""ddplab.start(init_method=None): bare ranks, where the student calls init_process_group.

Real engines, real gloo. The two-prompt style of the classic tutorial: rank 0's
init waits (the %%rank cell returns after its grace period), rank 1's completes
both; then the lab works as one that joined by itself.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
from conftest import alive, my_process_tree, side_lab
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

import ddplab
from ddplab.lab import Lab

pytestmark = pytest.mark.slow

TIMEOUT = 20


def make_bare_lab(world_size: int = 2, timeout: float = TIMEOUT) -> Lab:
    """A bare lab beside the session's labs (ddplab.start would replace the 2-rank one)."""
    return side_lab(world_size, timeout=timeout, grace=1.0, init_method=None)


@pytest.fixture
def bare():
    lab = make_bare_lab()
    ddplab.lab.current_lab.make_current(lab)        # checkers and ddplab.show find it
    yield lab
    lab.stop()


def facts():
    """On a rank: what torch.distributed and the environment say, and what the namespace offers."""
    import os

    import torch.distributed as dist

    from ddplab.rank.engine import namespace
    ns = namespace()
    return {"initialized": dist.is_initialized(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "names": {k: ns.get(k) for k in ("rank", "world_size", "port", "lab_dir")}}


def group_sum():
    import torch
    import torch.distributed as dist
    t = torch.tensor([dist.get_rank() + 1.0, 0.5])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t


def rank_of_group():
    import torch.distributed as dist
    return dist.get_rank()


def ping_pong(x):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 0:
        dist.send(x, dst=1)
        reply = torch.empty_like(x)
        dist.recv(reply, src=1)
        return reply
    got = torch.empty_like(x)
    dist.recv(got, src=0)
    dist.send(2 * got, dst=0)
    return got


def assert_group_works(lab: Lab) -> None:
    n = lab.world_size
    expected = torch.tensor([n * (n + 1) / 2, 0.5 * n])
    for rank, (torch_rank, size, total) in enumerate(lab.run(group_sum)):
        assert (torch_rank, size) == (rank, n)
        assert torch.equal(total, expected)


ENV_INIT = """
import os
import torch.distributed as dist
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = str(port)
os.environ["RANK"] = "{rank}"
os.environ["WORLD_SIZE"] = "2"
dist.init_process_group("gloo", init_method="env://")
print("joined as", dist.get_rank(), "of", dist.get_world_size())
"""

TCP_INIT = """
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank={rank}, world_size=2)
print("joined as", dist.get_rank(), "of", dist.get_world_size())
"""


def test_bare_start_initialises_nothing_and_offers_one_free_port(bare):
    got = bare.run(facts)
    assert [f["initialized"] for f in got] == [False, False]
    assert all(value is None for f in got for value in f["env"].values())
    names = [f["names"] for f in got]
    assert [n["rank"] for n in names] == [0, 1] and {n["world_size"] for n in names} == {2}
    ports = {n["port"] for n in names}
    assert len(ports) == 1 and 1024 <= ports.pop() < 65536           # both prompts agree
    lab_dir = names[0]["lab_dir"]
    assert {n["lab_dir"] for n in names} == {lab_dir} and os.listdir(lab_dir) == []
    assert os.path.dirname(lab_dir) == bare.directory             # removed with the lab at stop


@pytest.mark.parametrize("init", [ENV_INIT, TCP_INIT], ids=["env", "tcp"])
def test_two_prompts_rank_0_waits_then_rank_1_completes_both(bare, init, capsys):
    begin = time.monotonic()
    bare.run_cell(init.format(rank=0), ranks=[0], grace=bare.spec.grace)
    waited = time.monotonic() - begin
    out = capsys.readouterr().out
    assert "rank 0 is waiting in init_process_group for the other ranks to join" in out
    assert "joined as" not in out                   # rank 0 is still waiting
    assert bare.spec.grace <= waited < TIMEOUT / 2
    bare.run_cell(init.format(rank=1), ranks=[1], grace=bare.spec.grace)
    assert capsys.readouterr().out == (
        "[rank 0] (the earlier cell that was still running)\njoined as 0 of 2\n"
        "[rank 1]\njoined as 1 of 2\n")
    # Everything else now works as on a lab that joined by itself.
    assert_group_works(bare)
    bare.run_cell("import torch\nt = torch.tensor([rank * 10.0])\ndist.all_reduce(t)\nprint(t.item())")
    assert capsys.readouterr().out == "[rank 0]\n10.0\n[rank 1]\n10.0\n"
    ddplab.check.ping_pong(ping_pong, lab=bare)
    assert "Correct" in capsys.readouterr().out


def test_the_magics_drive_a_bare_lab(bare, capsys):
    shell = start_ipython() or get_ipython()   # the one test shell, whoever started it
    shell.run_line_magic("load_ext", "ddplab")
    shell.run_cell("%%rank 0\n" + TCP_INIT.format(rank=0))
    assert "rank 0 is waiting in init_process_group" in capsys.readouterr().out
    result = shell.run_cell("%%rank 1\n" + TCP_INIT.format(rank=1))
    assert result.error_in_exec is None
    assert "joined as 0 of 2" in capsys.readouterr().out
    picture = ddplab.show(lambda: __import__("torch").tensor([rank_of_group() * 2.0]), lab=bare)
    assert picture.values() == {0: (0.0,), 1: (2.0,)}


def test_destroy_then_a_new_group_and_restart_back_to_bare(bare, capsys):
    bare.run_cell(TCP_INIT.format(rank="rank"))          # one %%ranks cell: `rank` on each
    assert_group_works(bare)
    bare.run_cell("dist.destroy_process_group()\nprint(dist.is_initialized())")
    assert capsys.readouterr().out.count("False") == 2
    bare.run_cell(TCP_INIT.format(rank="rank"))          # the same port, a new group
    assert_group_works(bare)
    old_pids, old_dir = bare.pids, bare.run(facts)[0]["names"]["lab_dir"]
    bare.restart()
    got = bare.run(facts)
    assert [f["initialized"] for f in got] == [False, False]
    assert all(value is None for f in got for value in f["env"].values())
    assert set(bare.pids).isdisjoint(old_pids)
    assert got[0]["names"]["lab_dir"] != old_dir and os.listdir(got[0]["names"]["lab_dir"]) == []
    bare.run_cell(ENV_INIT.replace('"{rank}"', "str(rank)"))
    assert_group_works(bare)


def test_a_world_size_that_never_fills_is_a_hang_error_that_explains(bare):
    timeout = 6
    wrong = TCP_INIT.format(rank="rank").replace("world_size=2", "world_size=3")
    begin = time.monotonic()
    with pytest.raises(ddplab.HangError) as info:
        bare.run_cell(wrong, timeout=timeout)
    took = time.monotonic() - begin
    assert timeout <= took < timeout + 10          # the timeout, plus reading two stacks
    message = str(info.value)
    # IPython drops the cell's leading blank line: init_process_group is on line 2.
    assert "rank 0: still in init_process_group (cell line 2)" in message
    assert "rank 1: still in init_process_group (cell line 2)" in message
    assert "waiting for the group to fill" in message
    assert "a world_size larger than the number of ranks that call it (this lab has 2)" in message
    assert "Recover with: lab.restart()" in message
    assert info.value.where == {0: "in init_process_group (cell line 2)",
                                1: "in init_process_group (cell line 2)"}
    bare.restart()
    assert [f["initialized"] for f in bare.run(facts)] == [False, False]


def test_a_rank_that_never_joins_is_a_hang_error(bare):
    bare.run_cell(TCP_INIT.format(rank=0), ranks=[0], grace=bare.spec.grace)
    with pytest.raises(ddplab.HangError, match="waiting for the group to fill") as info:
        bare.wait(timeout=3)
    assert info.value.states == {0: "still running"}


def test_stop_with_a_half_built_group_leaves_nothing_behind():
    before = my_process_tree()
    lab = make_bare_lab()
    try:
        pids, lab_dir, files = lab.pids, lab.directory, lab.run(facts)[1]["names"]["lab_dir"]
        assert all(alive(pid) for pid in pids)
        # Rank 0 waits in a tcp:// group, rank 1 in a file:// group in the lab's directory.
        lab.run_cell(TCP_INIT.format(rank=0), ranks=[0], grace=0.5)
        lab.run_cell("import os, torch.distributed as dist\n"
                     "dist.init_process_group('gloo', init_method='file://' + "
                     "os.path.join(lab_dir, 'group'), rank=1, world_size=2)", ranks=[1], grace=0.5)
        assert os.path.exists(os.path.join(files, "group"))
    finally:
        lab.stop()
    assert not any(alive(pid) for pid in pids)
    assert not os.path.exists(lab_dir)
    assert my_process_tree() <= before
    assert not lab.running


def test_start_init_method_none_gives_a_bare_lab():
    with ddplab.start(world_size=2, backend="gloo", timeout=30, init_method=None) as lab:
        assert lab.spec.init_method is None
        assert [f["initialized"] for f in lab.run(facts)] == [False, False]


def test_a_wrong_port_is_a_hang_error_that_names_the_meeting_point(bare):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))          # bound, never listening: every connect is refused
        wrong = unused.getsockname()[1]
        bare.run_cell(TCP_INIT.format(rank=0), ranks=[0], grace=bare.spec.grace)
        rank_1 = TCP_INIT.format(rank=1).replace("{port}", str(wrong))
        with pytest.raises(ddplab.HangError) as info:
            bare.run_cell(rank_1, ranks=[1], timeout=6)
    message = str(info.value)
    assert "rank 0: still in init_process_group" in message
    assert "rank 1: still in init_process_group" in message
    assert "ranks given different ports, addresses or files" in message
    bare.restart()
    assert [f["initialized"] for f in bare.run(facts)] == [False, False]


def test_a_trace_records_a_group_the_student_made(bare):
    bare.run_cell(TCP_INIT.format(rank="rank"))          # the student's own init, one cell
    with bare.trace() as tr:
        bare.run(group_sum)
    ops = {(e.rank, e.op) for e in tr.events}
    assert {(0, "all_reduce"), (1, "all_reduce")} <= ops, tr.events
