"""The library refusal of the build-it chapters: one process, no group needed.

``refusing_library`` replaces ``__init__`` of the class every use of a library
constructs, so these calls fail before they would need a process group, and
the message names the exercise and the library however it was imported.
"""

import pytest
import torch

from ddplab.check._forbid import LIBRARY, refusing_library


def _refused(name: str, build) -> str:
    with refusing_library((name,), "my_ddp", builds="DDP"):
        with pytest.raises(AssertionError) as raised:
            build()
    return str(raised.value)


def test_ddp_is_refused_under_any_name_and_restored_after():
    from torch.nn.parallel import DistributedDataParallel as Wrapped  # an alias taken before

    original = Wrapped.__init__
    message = _refused("DistributedDataParallel", lambda: Wrapped(torch.nn.Linear(2, 2)))
    assert "my_ddp builds DDP by hand" in message and "DistributedDataParallel" in message
    assert "test_check_forbid.py" in message            # the student's line, not torch's
    assert Wrapped.__init__ is original


def test_zero_fully_shard_and_p2pop_are_refused():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = list(torch.nn.Linear(2, 2).parameters())
    assert "ZeroRedundancyOptimizer" in _refused(
        "ZeroRedundancyOptimizer", lambda: ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1))
    assert "fully_shard" in _refused("fully_shard", lambda: fully_shard(torch.nn.Linear(2, 2)))
    assert "batch_isend_irecv" in _refused(
        "batch_isend_irecv", lambda: dist.P2POp(dist.isend, torch.zeros(1), 1))


def test_every_pipelining_schedule_and_stage_is_refused_and_inherited_inits_come_back():
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    had_own = "__init__" in ScheduleGPipe.__dict__
    for build in (lambda: ScheduleGPipe(None, 2), lambda: Schedule1F1B(None, 2),
                  lambda: PipelineStage(torch.nn.Linear(2, 2), 0, 2, torch.device("cpu"))):
        assert "torch.distributed.pipelining" in _refused("torch.distributed.pipelining", build)
    assert ("__init__" in ScheduleGPipe.__dict__) == had_own
    assert _PipelineSchedule.__init__.__qualname__ == "_PipelineSchedule.__init__"


def test_an_unknown_library_names_the_known_ones():
    with pytest.raises(ValueError, match="knows DistributedDataParallel") as raised:
        with refusing_library(("DataParallel",), "x", builds="y"):
            pass
    assert "not DataParallel" in str(raised.value) and all(n in str(raised.value) for n in LIBRARY)


def test_torchs_compression_hooks_are_refused_through_any_alias_and_restored():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook as taken

    def wrapper(state, bucket):                 # the bypass: torch's hook under another name
        return taken(state, bucket)

    code = taken.__code__
    with refusing_library(("torch's compression hooks",), "bf16_hook", builds="a compression hook"):
        for call in (lambda: wrapper(None, None), lambda: default_hooks.fp16_compress_hook(None, None),
                     lambda: default_hooks._compress_hook(torch.bfloat16, None, None)):
            with pytest.raises(AssertionError, match="bf16_hook builds a compression hook by hand, so it "
                                                     "may not use torch's compression hooks") as raised:
                call()
            assert " line " in str(raised.value)         # the student's line
    assert taken.__code__ is code and default_hooks.bf16_compress_hook is taken
