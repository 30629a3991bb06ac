"""The notebook 03 checkers against one right and several wrong answers, on real engines."""

from __future__ import annotations

import pytest

import ddplab
from ddplab.launch import Launch


def right_barrier(store, world_size):
    if store.add("arrived", 1) == world_size:
        store.set("all_arrived", "yes")
    store.wait(["all_arrived"])


def no_wait_barrier(store, world_size):
    store.add("arrived", 1)                     # counts itself in, but never waits


def early_barrier(store, world_size):
    store.add("arrived", 1)
    store.set("all_arrived", "yes")             # does not wait for the count to reach world_size
    store.wait(["all_arrived"])


@pytest.mark.slow
def test_store_barrier_accepts_a_right_barrier(fresh_lab, capsys):
    ddplab.check.store_barrier(right_barrier)
    assert capsys.readouterr().out.splitlines()[-1] == \
        "Correct: the barrier waits for all 2 ranks, and times out when one is missing."


@pytest.mark.exercise("store_barrier", "mistake", "counts itself in, never waits")
@pytest.mark.exercise("store_barrier", "mistake", "releases before everyone arrived")
@pytest.mark.slow
@pytest.mark.parametrize("wrong", [no_wait_barrier, early_barrier])
def test_store_barrier_rejects_a_barrier_that_does_not_wait(fresh_lab, wrong):
    with pytest.raises(AssertionError) as info:
        ddplab.check.store_barrier(wrong)
    message = str(info.value)
    assert message.startswith("store_barrier with only rank 0 of 2 arriving is wrong on rank 0.")
    assert "expected 'timed out'" in message and "got      'returned'" in message


@pytest.mark.slow
def test_store_barrier_shows_a_students_exception_per_rank(fresh_lab):
    def broken(store, world_size):
        store.add("arrived", "one")             # add takes an int
    with pytest.raises(AssertionError,
                       match=r"(?s)round 1\) is wrong on ranks 0, 1.*raised TypeError: add\(\)"):
        ddplab.check.store_barrier(broken)


def fake_two_node_launch(nnodes=2, nproc=2, port="41234"):
    """What launch.torchrun(..., nnodes=2, nproc_per_node=2) reports: torchrun's own env."""
    reports = {}
    for node in range(nnodes):
        for local in range(nproc):
            rank = node * nproc + local
            reports[rank] = {"RANK": str(rank), "LOCAL_RANK": str(local),
                             "WORLD_SIZE": str(nnodes * nproc), "LOCAL_WORLD_SIZE": str(nproc),
                             "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": port}
    return Launch([["torchrun"]] * nnodes, [0] * nnodes, False, "", {}, reports)


def test_global_rank_accepts_the_formula(capsys):
    ddplab.check.global_rank(lambda node, local, nproc: node * nproc + local, fake_two_node_launch())
    assert capsys.readouterr().out.startswith("Correct: global rank = node_rank * nproc_per_node")


@pytest.mark.parametrize("wrong,words", [
    (lambda node, local, nproc: local * 2 + node, "torchrun's workers is wrong on ranks 1, 2"),
    (lambda node, local, nproc: node + local, "torchrun's workers is wrong on ranks 2, 3"),
    (lambda node, local, nproc: node * 2 + local, "3-node x 4-process job is wrong"),  # hard-coded 2
])
@pytest.mark.exercise("global_rank", "mistake", "local * 2 + node")
@pytest.mark.exercise("global_rank", "mistake", "node + local")
@pytest.mark.exercise("global_rank", "mistake", "nproc hard-coded to 2")
def test_global_rank_rejects_wrong_formulas(wrong, words):
    with pytest.raises(AssertionError, match=words):
        ddplab.check.global_rank(wrong, fake_two_node_launch())


def test_global_rank_without_a_launch_says_what_to_run():
    with pytest.raises(AssertionError,
                       match="(?s)the two-node torchrun cell above has not run.*Hint: run it"):
        ddplab.check.global_rank(lambda *a: 0, None)


def right_env(node_rank, local_rank, nnodes, nproc_per_node, master_addr, master_port):
    return {"RANK": str(node_rank * nproc_per_node + local_rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nnodes * nproc_per_node), "LOCAL_WORLD_SIZE": str(nproc_per_node),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def test_launcher_env_accepts_torchruns_contract(capsys):
    ddplab.check.launcher_env(right_env, fake_two_node_launch())
    assert capsys.readouterr().out.startswith("Correct: your launcher sets the same")


def ints_env(*args):
    return {k: int(v) if v.isdigit() else v for k, v in right_env(*args).items()}


def local_world_env(node_rank, local_rank, nnodes, nproc_per_node, master_addr, master_port):
    env = right_env(node_rank, local_rank, nnodes, nproc_per_node, master_addr, master_port)
    return dict(env, WORLD_SIZE=str(nproc_per_node))


def no_port_env(*args):
    env = right_env(*args)
    del env["MASTER_PORT"]
    return env


@pytest.mark.parametrize("wrong,words", [
    (ints_env, "wrong on ranks 0, 1, 2, 3.*strings"),
    (local_world_env, "wrong on ranks 0, 1, 2, 3.*'WORLD_SIZE': '2'"),
    (no_port_env, "<missing>"),
])
@pytest.mark.exercise("launcher_env", "mistake", "ints, not strings")
@pytest.mark.exercise("launcher_env", "mistake", "WORLD_SIZE of one node")
@pytest.mark.exercise("launcher_env", "mistake", "no MASTER_PORT")
def test_launcher_env_rejects_wrong_envs(wrong, words):
    with pytest.raises(AssertionError, match=f"(?s){words}"):
        ddplab.check.launcher_env(wrong, fake_two_node_launch())


def _formula_only_on_a_rank(node, local, nproc):
    """Right on a lab's rank, wrong anywhere else: shows where the checker ran it."""
    from ddplab.rank.engine import in_lab
    return node * nproc + local if in_lab() else -1


def test_global_rank_runs_the_function_on_rank_0_of_a_running_lab(fresh_lab, capsys):
    """Where a grader can check it without running the student's code itself
    (ddplab.grade.witness); with no lab it runs here."""
    ddplab.check.global_rank(_formula_only_on_a_rank, fake_two_node_launch())
    assert capsys.readouterr().out.startswith("Correct: global rank = node_rank * nproc_per_node")
    with pytest.raises(AssertionError, match=r"(?s)^ZeroDivisionError: integer division or modulo by "
                                             r"zero \(.*line \d+, in <lambda>\)\..*It raised when the "
                                             r"check called global_rank\(0, 0, 2\)\."):
        ddplab.check.global_rank(lambda node, local, nproc: 1 // 0, fake_two_node_launch())
