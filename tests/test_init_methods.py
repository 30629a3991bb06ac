"""ddplab.start(init_method=...): env://, tcp:// and file:// on real engines, and bad values."""

from __future__ import annotations

import os
import time

import pytest
import torch
from conftest import lab_dirs, my_process_tree, side_lab

import ddplab
from ddplab.lab import Lab

pytestmark = pytest.mark.slow


def group_facts(values):
    """On a rank: all_reduce its row of ``values``, and say how the group was made."""
    import os

    import torch
    import torch.distributed as dist
    t = torch.tensor(values[dist.get_rank()], dtype=torch.float64)
    dist.all_reduce(t)
    return {"sum": t, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}}


def make_lab(init_method: str, world_size: int = 2) -> Lab:
    """A lab beside the session's labs (ddplab.start would replace the 2-rank one)."""
    return side_lab(world_size, init_method=init_method)


def assert_group_works(lab: Lab) -> list[dict]:
    n = lab.world_size
    values = [[float(r + 1), -2.5 * r, 0.125] for r in range(n)]
    reference = torch.tensor(values, dtype=torch.float64).sum(0)
    facts = lab.run(group_facts, values)
    for rank, fact in enumerate(facts):
        assert torch.equal(fact["sum"], reference)
        assert (fact["rank"], fact["world_size"], fact["backend"]) == (rank, n, "gloo")
        assert fact["env"]["RANK"] == str(rank) and fact["env"]["WORLD_SIZE"] == str(n)
    return facts


@pytest.mark.parametrize("method", ["env", "tcp"])
def test_env_and_tcp_meet_at_a_free_port(method):
    lab = make_lab(method, world_size=3)
    try:
        facts = assert_group_works(lab)
        ports = {f["env"]["MASTER_PORT"] for f in facts}
        assert len(ports) == 1 and ports.pop().isdigit()
        assert {f["env"]["MASTER_ADDR"] for f in facts} == {"127.0.0.1"}
    finally:
        lab.stop()


def test_file_uses_a_fresh_file_in_the_labs_directory_each_time():
    lab = make_lab("file")
    try:
        facts = assert_group_works(lab)
        # No TCP rendezvous at all, so no MASTER_ADDR / MASTER_PORT to mislead anyone.
        assert all(f["env"]["MASTER_ADDR"] is None and f["env"]["MASTER_PORT"] is None for f in facts)
        first = set(os.listdir(lab.directory))
        assert [name for name in first if name.startswith("init-file")] == ["init-file-1"]
        lab.restart()                    # a reused file would deadlock here
        files = [name for name in os.listdir(lab.directory) if name.startswith("init-file")]
        assert files == ["init-file-2"], files      # a new file; the old one is gone
        assert_group_works(lab)
    finally:
        lab.stop()


def test_start_passes_init_method_to_the_ranks():
    with ddplab.start(world_size=2, backend="gloo", timeout=60, init_method="tcp") as lab:
        assert lab.spec.init_method == "tcp"
        assert_group_works(lab)


def test_default_is_the_prebound_store():
    spec = ddplab.lab.LabSpec(world_size=2, backend="gloo", timeout=60, grace=2.0,
                                      pg_timeout=1800, debug=False)
    assert spec.init_method == "store"


@pytest.mark.parametrize("value,words", [
    ("env://", r"init_method='env://' is a URL.*Use init_method='env'"),
    ("tcp://127.0.0.1:29500", r"is a URL, but ddplab builds the URL itself.*Use init_method='tcp'"),
    ("file:///tmp/x", r"Use init_method='file'"),
    ("mpi", r"init_method='mpi' is not one ddplab knows. Use one of 'store', 'env', 'tcp', 'file'"),
    ("", r"init_method='' is not one ddplab knows.*or None for bare ranks"),
    (3, r"init_method=3 is not one ddplab knows"),
])
def test_bad_init_method_fails_fast_and_starts_nothing(value, words):
    before = my_process_tree()
    dirs_before = lab_dirs()
    begin = time.perf_counter()
    with pytest.raises(ddplab.ConfigError, match=words) as info:
        ddplab.start(world_size=2, backend="gloo", init_method=value)
    # A fraction of the timeout a start that went ahead would wait for (60 s).
    assert time.perf_counter() - begin < 0.05 * 60
    assert "Use" in str(info.value)
    assert my_process_tree() <= before
    assert lab_dirs() <= dirs_before
