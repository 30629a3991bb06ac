"""Issue 19 item 12: a lab larger than the machine is refused (memory) or warned about (cores)."""

import psutil
import pytest

import ddplab
from ddplab.env import LAB_MEMORY_BYTES, check_fits, rank_memory


def test_world_size_past_memory_is_refused_before_any_process_starts(monkeypatch):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    free = LAB_MEMORY_BYTES + 24 * rank_memory() + 1

    class Memory:
        available = free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    with pytest.raises(ddplab.ConfigError) as info:
        ddplab.start(world_size=64, backend="gloo")
    message = str(info.value)
    assert "world_size=64 does not fit in this machine's free memory" in message, message
    assert "enough for 24 ranks" in message, message
    assert "Use world_size=8 or fewer" in message
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_this_machine_refuses_world_size_64_or_names_what_fits():
    # Refused here unless that much is free right now.
    available = psutil.virtual_memory().available
    if available >= LAB_MEMORY_BYTES + 64 * rank_memory():
        assert "take turns" in check_fits(64)
    else:
        with pytest.raises(ddplab.ConfigError, match="does not fit"):
            check_fits(64)


def test_many_ranks_per_core_warn_and_name_what_runs_well():
    assert check_fits(4, available=2**40, cores=2) == ""
    warning = check_fits(9, available=2**40, cores=2)
    assert "world_size=9 on 2 CPU cores" in warning and "Up to 8 ranks run well" in warning


@pytest.mark.slow
def test_a_start_past_the_cores_warns(fresh_lab, monkeypatch, capsys):
    monkeypatch.setattr("ddplab.limits.cpus", lambda: 1)
    lab = ddplab.start(world_size=5, backend="gloo", timeout=60)
    try:
        assert "warning: world_size=5 on 1 CPU core" in capsys.readouterr().out
        assert lab.run(lambda: 1) == [1] * 5
    finally:
        lab.stop()
