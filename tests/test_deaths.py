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


INT_SENT_FLOAT_RECEIVED = """
if rank == 0:
    dist.send(torch.tensor([1, 2, 3]), dst=1)        # int64: 24 bytes
elif rank == 1:
    buf = torch.zeros(3)                             # float32: room for 12
    dist.recv(buf, src=0)
"""


def _cell_died(lab, source) -> str:
    with pytest.raises(ddplab.EngineDiedError) as info:
        lab.run_cell(source, timeout=20)
    return str(info.value)


def test_a_dtype_mismatch_in_a_plain_cell_is_named_as_such(fresh_lab):
    """gloo aborts the receiving rank; the report names the call and the mismatch, not 'a collective'."""
    message = _cell_died(fresh_lab, INT_SENT_FLOAT_RECEIVED)
    assert "rank 1 aborted (SIGABRT) in recv (cell line 5): a dtype or size mismatch between a " \
           "send and its receive" in message, message
    assert "torch.zeros(3) is float32" in message and "dtype=torch.int64" in message
    assert "In a collective" not in message
    fresh_lab.restart()


def test_a_dtype_mismatch_in_an_irecv_is_named_too(fresh_lab):
    source = INT_SENT_FLOAT_RECEIVED.replace("dist.send(torch.tensor([1, 2, 3]), dst=1)",
                                             "dist.isend(torch.tensor([1, 2, 3]), dst=1).wait()")
    source = source.replace("dist.recv(buf, src=0)", "request = dist.irecv(buf, src=0)\n"
                                                     "    request.wait()")
    message = _cell_died(fresh_lab, source)
    assert "rank 1 aborted (SIGABRT) at cell line 6: a C++ error inside torch, most often a dtype " \
           "or size mismatch between ranks. Between a send (or isend) and its receive" in message, \
        message
    assert "torch.zeros(3) is float32" in message
    fresh_lab.restart()
