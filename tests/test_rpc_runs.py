"""An RPC program runs again and again on the same ranks (issue 42), through lab.spawn and
lab.run_script: RPC is ended and reset after the code, as the end of its process would."""

from __future__ import annotations

import textwrap

import torch


def rpc_add(rank: int, world_size: int) -> float:
    """Each rank asks the next to add its rank to one, over RPC, and shuts RPC down."""
    import torch.distributed.rpc as rpc
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    answer = rpc.rpc_sync(f"worker{(rank + 1) % world_size}", torch.add,
                          args=(torch.ones(1), rank))
    rpc.shutdown()
    return float(answer)


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


def rpc_agent_set() -> bool:
    from torch.distributed.rpc import api
    return api._is_current_rpc_agent_set()


def test_an_rpc_function_spawned_twice_runs_both_times(fresh_lab):
    # Before: rank 0's init_rpc served a store at MASTER_PORT, the run's store: EADDRINUSE.
    for _ in range(2):
        assert fresh_lab.spawn(rpc_add, args=(2,)) == [1.0, 2.0]
    assert fresh_lab.run(world_size) == [2, 2]                   # the lab's group is back


def test_an_rpc_script_without_shutdown_runs_twice_and_is_told(fresh_lab, tmp_path, capsys):
    script = tmp_path / "rpc_noshutdown.py"
    script.write_text(textwrap.dedent("""
        import os, torch
        import torch.distributed.rpc as rpc
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
        print("got", rpc.rpc_sync(f"w{1 - rank}", torch.mul, args=(torch.ones(1), 3)).item())
    """))
    for _ in range(2):      # before: the second run failed with "RPC is already initialized"
        fresh_lab.run_script(str(script))
        captured = capsys.readouterr()
        assert captured.out.count("got 3.0") == 2, captured.out
        assert "left RPC running on this rank (no rpc.shutdown()" in captured.err
        assert "without forming a process group" not in captured.err     # RPC is a group of ranks
    assert fresh_lab.run(rpc_agent_set) == [False, False]
