"""Issue 19 item 8: a dead engine is reported with its exit code or signal and the likely cause."""

import os
import signal

import pytest

import ddplab

pytestmark = pytest.mark.slow


def _exit_3():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        os._exit(3)
    return "alive"


def _signal(number):
    def die():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            signal.raise_signal(number)
            import time
            time.sleep(5)
        return "alive"
    return die


def _mismatched_all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(3 if dist.get_rank() == 0 else 5)
    dist.all_reduce(t)
    return t.tolist()


def _died(lab, fn) -> str:
    with pytest.raises(ddplab.EngineDiedError) as info:
        lab.run(fn, timeout=20)
    return str(info.value)


def test_exit_code_is_reported(fresh_lab):
    message = _died(fresh_lab, _exit_3)
    assert "rank 1 exited with code 3" in message, message
    assert "out of memory" not in message


def test_segfault_is_reported(fresh_lab):
    message = _died(fresh_lab, _signal(signal.SIGSEGV))
    assert "rank 1 crashed (SIGSEGV, a segmentation fault)" in message, message


def test_sigkill_suggests_out_of_memory(fresh_lab):
    message = _died(fresh_lab, _signal(signal.SIGKILL))
    assert "rank 1 was killed (SIGKILL): most likely out of memory" in message, message


def test_abort_in_a_collective_suggests_shapes_and_debug(fresh_lab):
    message = _died(fresh_lab, _mismatched_all_reduce)
    assert "aborted (SIGABRT)" in message, message
    assert "different shapes" in message and "debug=True" in message
