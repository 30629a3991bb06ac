"""The notebook-06 checkers refuse answers that get the sum without building it: ddplab's own
all_reduce, dist.all_reduce under any name, the checker's frames, a collective below
torch.distributed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from allreduce_answers import NAIVE
from torch.distributed import all_reduce as sum_everywhere  # an alias bound before any check runs

from ddplab import algorithms
from ddplab.check.nb06_build_all_reduce import methods as check

pytestmark = pytest.mark.slow


def ring_that_calls_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


def naive_through_an_alias(tensor):
    sum_everywhere(tensor)
    return tensor


def ring_that_calls_the_shipped_ring(tensor):
    from ddplab.algorithms import ring_all_reduce as mine
    return mine(tensor)


def _copied_from_the_installed_file(name: str):
    """The attack: the reference's source read from ddplab's file, exec'd under the student's name."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(getattr(algorithms, name))).replace(name, "my_ring")
    space = {**vars(algorithms), "__name__": "__main__"}
    exec(compile(source, "<cell 7>", "exec"), space)
    return space["my_ring"]


@pytest.mark.parametrize("checker, answer, name", [
    (check.ring_all_reduce, algorithms.ring_all_reduce, "ring_all_reduce"),
    (check.ring_all_reduce, ring_that_calls_the_shipped_ring, "ring_all_reduce"),
    (check.ring_all_reduce, _copied_from_the_installed_file("ring_all_reduce"), "ring_all_reduce"),
    (check.ring_all_reduce, algorithms.naive_all_reduce, "naive_all_reduce"),
    (check.naive_all_reduce, algorithms.naive_all_reduce, "naive_all_reduce"),
    (check.naive_all_reduce_collectives, algorithms.naive_all_reduce_collectives,
     "naive_all_reduce_collectives"),
    (check.tree_all_reduce, algorithms.tree_all_reduce, "tree_all_reduce"),
    (check.recursive_doubling_all_reduce, algorithms.recursive_doubling_all_reduce,
     "recursive_doubling_all_reduce"),
])
def test_an_answer_that_calls_ddplabs_own_all_reduce_fails(fresh_lab4, checker, answer, name):
    with pytest.raises(AssertionError) as info:
        checker(answer)
    assert f"runs ddplab.algorithms.{name} (the reference solution that ships with ddplab" \
        in str(info.value)
    assert not fresh_lab4.broken_reason       # every rank refused at once: nobody is left waiting


def test_send_recv_exercise_may_not_call_all_reduce(fresh_lab4):
    with pytest.raises(AssertionError, match=r"may not call dist\.all_reduce"):
        check.ring_all_reduce(ring_that_calls_all_reduce)
    assert not fresh_lab4.broken_reason       # every rank refused at once: nobody is left waiting


def test_send_recv_exercise_refuses_all_reduce_under_any_name(fresh_lab):
    """``from torch.distributed import all_reduce as sum_everywhere`` at module level, bound before
    the check, is the real function: the check refuses the collective at the process group."""
    with pytest.raises(AssertionError, match=r"naive_all_reduce builds all_reduce from send/recv, so "
                       r"it may not call dist\.all_reduce \(at naive_through_an_alias line \d+\)"):
        check.naive_all_reduce(naive_through_an_alias)
    assert not fresh_lab.broken_reason
    check.naive_all_reduce(NAIVE)             # and all_reduce works again afterwards


# ---------------------------------------------------------------- answers that want the verdict for free
def reads_the_checkers_frames(tensor):
    """Copies whatever answer a frame of the checker holds on this rank, without communicating."""
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        for name in ("expected", "answer", "total", "result"):
            value = frame.f_locals.get(name)
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                tensor.copy_(value)
                return tensor
        frame = frame.f_back
    return tensor


def recomputes_the_other_ranks_inputs(tensor):
    """Every rank's input remade here from the case's seed (as `_make` draws it), and summed."""
    import sys
    frame = sys._getframe(1)
    while frame is not None and not {"case", "seed"} & set(frame.f_locals):
        frame = frame.f_back
    found = frame.f_locals
    shape, dtype, seed = ((found["shape"], found["dtype"], found["seed"]) if "seed" in found
                          else found["case"])
    total = sum(check._make(shape, dtype, seed, r) for r in range(dist.get_world_size()))
    tensor.copy_(total)
    return tensor


def patches_the_comparisons(tensor):
    """Does nothing, and makes every comparison on the rank say "equal"."""
    torch.isclose = lambda a, b, *args, **kwargs: torch.ones_like(a, dtype=torch.bool)
    torch.Tensor.__ne__ = lambda self, other: torch.zeros_like(self, dtype=torch.bool)
    torch.equal = lambda a, b: True
    return tensor


@pytest.mark.parametrize("answer", [reads_the_checkers_frames, recomputes_the_other_ranks_inputs,
                                    patches_the_comparisons], ids=lambda f: f.__name__)
def test_the_verdict_is_made_where_the_answer_did_not_run(fresh_lab, answer):
    """Issue 46: each rank is sent only its own input, drawn from a seed no rank sees, and the
    checker compares what comes back with its own torch; the stub of each attack fails."""
    with pytest.raises(AssertionError) as info:
        check.naive_all_reduce(answer)
    message = str(info.value)
    assert "naive_all_reduce is wrong on" in message or "raised" in message, message
    fresh_lab.restart()          # the patches live on its ranks


def sums_with_a_functional_collective(tensor):
    """torch's functional all_reduce: past the process group's Python methods, into C++."""
    import torch.distributed._functional_collectives as functional
    tensor.copy_(functional.wait_tensor(functional.all_reduce(tensor, "sum", dist.group.WORLD)))
    return tensor


def sums_through_torch_ops(tensor):
    """The op under the functional collectives, called directly."""
    import torch as on_the_rank  # here: cloudpickle cannot send torch.ops itself
    ops = on_the_rank.ops._c10d_functional
    tensor.copy_(ops.wait_tensor(ops.all_reduce(tensor, "sum", dist.group.WORLD.group_name)))
    return tensor


@pytest.mark.parametrize("answer", [sums_with_a_functional_collective, sums_through_torch_ops],
                         ids=lambda f: f.__name__)
def test_a_collective_issued_below_torch_distributed_is_refused(fresh_lab, answer):
    """Issue 46 item 2: torch's flight recorder, in the process group's C++ code, sees it."""
    # Imported first: on a loaded machine its import alone has outlasted the check's timeout.
    fresh_lab.run(lambda: __import__("torch.distributed._functional_collectives"), timeout=120)
    with pytest.raises(AssertionError) as info:
        check.naive_all_reduce(answer)
    message = str(info.value)
    assert "may not issue all_reduce: torch's flight recorder saw collective #" in message, message
    assert "functional collective" in message


def hides_a_collective_behind_many_barriers(tensor):
    """A functional all_reduce, then more barriers (allowed) than the flight recorder keeps."""
    import os

    import torch.distributed._functional_collectives as functional
    tensor.copy_(functional.wait_tensor(functional.all_reduce(tensor, "sum", dist.group.WORLD)))
    for _ in range(int(os.environ["TORCH_FR_BUFFER_SIZE"]) + 10):
        dist.barrier()
    return tensor


def test_a_collective_pushed_out_of_the_recorder_is_still_refused(fresh_lab):
    fresh_lab.run(lambda: __import__("torch.distributed._functional_collectives"), timeout=120)
    with pytest.raises(AssertionError, match="more operations in one call than torch's flight recorder"):
        check.naive_all_reduce(hides_a_collective_behind_many_barriers)
