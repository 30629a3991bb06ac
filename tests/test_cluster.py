"""The Lab on real engines and real gloo: run, ranks, errors, lifecycle."""

import os

import pytest
import torch
from conftest import alive, my_process_tree

import ddplab


def rank_and_env():
    import torch
    import torch.distributed as dist
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    return dist.get_rank(), dict({k: os.environ[k] for k in keys}, threads=torch.get_num_threads(),
                                 master=[k for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ])


def all_reduce_sum(values):
    import torch
    import torch.distributed as dist
    t = torch.tensor(values[dist.get_rank()], dtype=torch.float64)
    dist.all_reduce(t)
    return t


def test_run_returns_results_indexed_by_rank(fresh_lab):
    results = fresh_lab.run(rank_and_env)
    assert [r for r, _ in results] == [0, 1]
    for rank, env in results:
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["master"] == []        # the ranks meet in a private file: no address, no port
        assert int(env["OMP_NUM_THREADS"]) >= 1
        assert env["threads"] == int(env["OMP_NUM_THREADS"])   # torch obeys it


def test_all_reduce_matches_single_process_reference(fresh_lab):
    values = [[1.5, -2.0, 3.0], [0.25, 4.0, -1.0]]
    reference = torch.tensor(values, dtype=torch.float64).sum(0)
    for result in fresh_lab.run(all_reduce_sum, values):
        assert torch.equal(result, reference)


def test_run_on_some_ranks_is_keyed_by_rank(fresh_lab):
    assert fresh_lab.run(lambda: __import__("torch.distributed").distributed.get_rank(),
                         ranks=[1]) == {1: 1}


def test_run_on_missing_rank_is_a_clear_error(fresh_lab):
    with pytest.raises(ddplab.ConfigError,
                       match=r"ranks=\[5\] names rank 5, but this lab has ranks 0..1 \(world_size=2\)"
                             r".*ddplab.start\(world_size=6\)"):
        fresh_lab.run(print, ranks=[5])
    with pytest.raises(ddplab.ConfigError, match=r"ranks=\[\] names no rank"):
        fresh_lab.run(print, ranks=[])
    with pytest.raises(ddplab.ConfigError, match=r"names rank '0'"):
        fresh_lab.run(print, ranks=["0"])


def test_run_of_something_not_callable_is_a_clear_error(fresh_lab):
    with pytest.raises(ddplab.ConfigError, match=r"lab.run needs a function.*got 5 \(int\)"):
        fresh_lab.run(5)


def test_negative_grace_is_a_clear_error(fresh_lab):
    with pytest.raises(ddplab.ConfigError, match=r"grace must be a positive, finite number.*grace=2"):
        fresh_lab.run_cell("1", ranks=[0], grace=-1)


def fail_on_rank_one():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("bad shard on rank one")
    return "fine"


def _raise_a_huge_message():
    raise ValueError("x" * 10_000_000)


def test_a_huge_error_message_is_cut_in_the_notebook_and_kept_whole_in_failures(fresh_lab):
    from ddplab.lab.calls import ERROR_CHARS

    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.run(_raise_a_huge_message)
    message = str(info.value)
    assert len(message) < 2 * ERROR_CHARS + 1000, len(message)      # not 2 x 10 MB
    assert "characters left out here; the whole text is in the error's .failures[1]" in message
    assert message.count("Traceback (most recent call last):") == 2          # each rank's start
    assert all(len(text) > 10_000_000 for text in info.value.failures.values())


def test_exception_on_a_rank_raises_rank_error_with_its_traceback(fresh_lab):
    with pytest.raises(ddplab.RankError) as info:
        fresh_lab.run(fail_on_rank_one)
    assert set(info.value.failures) == {1}
    assert "--- rank 1 ---" in str(info.value)
    assert "ValueError: bad shard on rank one" in info.value.failures[1]
    assert "fail_on_rank_one" in info.value.failures[1]
    assert fresh_lab.run(lambda: 7) == [7, 7]        # the lab is still usable


def test_output_is_grouped_in_rank_order(fresh_lab, capsys):
    def noisy():
        import random
        import time

        import torch.distributed as dist
        time.sleep(random.random() * 0.1)
        print("hello from", dist.get_rank())

    outputs = set()
    for _ in range(5):
        fresh_lab.run(noisy)
        outputs.add(capsys.readouterr().out)
    assert outputs == {"[rank 0]\nhello from 0\n[rank 1]\nhello from 1\n"}


def test_start_with_same_arguments_returns_the_running_lab(lab):
    ddplab.lab.current_lab.make_current(lab)
    again = ddplab.start(world_size=2, backend="gloo", timeout=30)
    assert again is lab and ddplab.current() is lab


def test_restart_keeps_ranks_and_replaces_processes(fresh_lab):
    old = fresh_lab.pids
    fresh_lab.restart()
    assert [r for r, _ in fresh_lab.run(rank_and_env)] == [0, 1]
    assert not any(alive(pid) for pid in old)
    assert set(old).isdisjoint(fresh_lab.pids)


@pytest.mark.slow
def test_context_manager_stops_and_start_replaces_a_different_lab(lab):
    before = my_process_tree()
    with ddplab.start(world_size=3, backend="gloo", timeout=30) as three:
        assert not lab.running                       # different arguments replace the lab
        assert three.run(lambda: 1) == [1, 1, 1]
        pids, lab_dir = three.pids, three.directory
        assert len(my_process_tree() - before) >= 4  # controller + 3 engines
    assert not three.running
    assert not any(alive(pid) for pid in pids)
    assert my_process_tree() <= before
    assert not os.path.exists(lab_dir)
    with pytest.raises(ddplab.DdplabError, match="no lab is running"):
        ddplab.current()
    lab.restart()                                     # give the session lab back
