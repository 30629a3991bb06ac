"""The pure functions: env vars, thread counts, backend choice, argument checks."""

import pytest

from ddplab.env import (
    MAX_LOCAL_WORLD_SIZE,
    check_timeout,
    check_world_size,
    choose_backend,
    free_port,
    omp_threads,
    worker_env,
)
from ddplab.errors import ConfigError


def test_worker_env_matches_torchrun_contract():
    env = worker_env(3, 4, "127.0.0.1", 29500)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "3" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500"
    assert all(isinstance(v, str) for v in env.values())


def test_worker_env_multi_node_local_rank():
    env = worker_env(5, 8, "10.0.0.1", 1234, local_rank=1, local_world_size=4, node_rank=1, nnodes=2)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("5", "1", "1")


@pytest.mark.parametrize("ranks,cpus,expected", [(4, 2, 1), (2, 2, 1), (2, 16, 8), (1, 8, 8)])
def test_omp_threads_shares_cores(ranks, cpus, expected):
    assert omp_threads(ranks, cpus) == expected


def test_free_port_is_bindable():
    import socket
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("gpus,backend", [(0, "gloo"), (1, "gloo"), (2, "nccl"), (8, "nccl")])
def test_auto_backend_needs_one_gpu_per_rank(gpus, backend):
    chosen, reason = choose_backend("auto", 2, gpus)
    assert chosen == backend
    assert reason.startswith(backend)


def test_auto_backend_explains_shared_gpus():
    assert "one GPU per rank" in choose_backend("auto", 4, 2)[1]


@pytest.mark.parametrize("gpus", [0, 1])
def test_nccl_without_enough_gpus_names_the_fix(gpus):
    with pytest.raises(ConfigError, match=r"backend='nccl' needs one GPU per rank.*backend='gloo'"):
        choose_backend("nccl", 2, gpus)


def test_unknown_backend_lists_choices():
    with pytest.raises(ConfigError, match=r"backend='mpich'.*'auto', 'gloo', 'nccl'"):
        choose_backend("mpich", 2, 0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "four", None, True, MAX_LOCAL_WORLD_SIZE + 1, 10**9])
def test_world_size_rejected_with_fix(bad):
    with pytest.raises(ConfigError, match=r"world_size.*(Use|at most)"):
        check_world_size(bad)


def test_timeout_rejected_with_fix():
    with pytest.raises(ConfigError, match=r"timeout must be a positive, finite number.*timeout=60"):
        check_timeout(0)
    for bad in (float("inf"), float("nan"), "10", None):
        with pytest.raises(ConfigError, match="positive, finite number"):
            check_timeout(bad)
    assert check_timeout(5) == 5.0
