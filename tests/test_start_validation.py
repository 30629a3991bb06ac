"""Bad input to ddplab.start fails in under a second, clearly, and starts no process."""

import inspect
import time

import pytest
from conftest import lab_dirs, my_process_tree

import ddplab

DEFAULT_TIMEOUT = inspect.signature(ddplab.start).parameters["timeout"].default
#: What "fails fast" means, relative to the timeout a start that went ahead would wait.
FAST_FRACTION = 0.05


@pytest.mark.parametrize("kwargs,words", [
    (dict(world_size=0), "world_size must be at least 1"),
    (dict(world_size=-1), "world_size must be at least 1"),
    (dict(world_size=2.5), "whole number"),
    (dict(world_size="four"), "whole number"),
    (dict(world_size=100_000), "more ranks than one machine runs"),
    (dict(world_size=65), "MB budgeted per rank"),
    (dict(world_size=2, backend="nccl"), "backend='nccl' needs one GPU per rank"),
    (dict(world_size=2, backend="mpich"), "backend='mpich' is not one ddplab knows"),
    (dict(world_size=2, timeout=-5), "timeout must be a positive, finite number"),
    (dict(world_size=2, timeout=float("inf")), "timeout must be a positive, finite number"),
    (dict(world_size=2, pg_timeout=float("nan")), "pg_timeout must be a positive, finite number"),
    (dict(world_size=2, grace=0), "grace must be a positive, finite number.*grace=2"),
    (dict(world_size=2, start_timeout=0), "start_timeout must be a positive, finite number"),
    (dict(world_size=2, backend=None), "backend=None is not one ddplab knows"),
    (dict(world_size=2, hosts=["127.0.0.1"], init_method=None), "init_method=None is for a lab on"),
    (dict(world_size=2, hosts=["127.0.0.1"], init_method="tcp"), "always joins its ranks at rank 0"),
])
def test_bad_input_fails_fast_and_starts_nothing(kwargs, words):
    before, dirs_before = my_process_tree(), lab_dirs()
    begin = time.perf_counter()
    with pytest.raises(ddplab.ConfigError, match=words) as info:
        ddplab.start(**kwargs)
    # A start that went ahead would fail only at its timeout; refused up front, it
    # takes a small fraction of it (and starts nothing, checked below).
    assert time.perf_counter() - begin < FAST_FRACTION * DEFAULT_TIMEOUT
    assert "Use" in str(info.value)          # every message names the fix
    assert my_process_tree() <= before
    assert lab_dirs() <= dirs_before
