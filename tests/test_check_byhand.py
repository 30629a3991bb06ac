"""Notebook 05's DDP-by-hand checkers, against right and wrong answers on a real 2-rank gloo lab."""

from __future__ import annotations

import pytest
from conftest import fails

import ddplab

pytestmark = pytest.mark.slow

PER_PARAMETER = """
def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
"""

FLAT = """
def average_gradients_flat(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
"""


def test_average_gradients_accepts_one_all_reduce_per_parameter(fresh_lab, capsys):
    fresh_lab.run_cell(PER_PARAMETER)
    ddplab.check.average_gradients()
    assert capsys.readouterr().out == \
        "Correct: 5 steps with average_gradients(model) end on DDP's weights, on every rank.\n"


@pytest.mark.parametrize("body, words", [
    ("    for p in model.parameters():\n        dist.all_reduce(p.grad)\n",
     "every gradient holds the sum over the 2 ranks, world_size times the mean: the all_reduce is "
     "there, the division is missing.\n"),
    ("    for p in model.parameters():\n        dist.all_reduce(p.grad)\n        p.grad /= 8\n",
     "every gradient is the mean times 0.25: the sum was divided by 8, not by world_size = 2.\n"),
    ("    for p in model.parameters():\n        g = p.grad.clone()\n        dist.all_reduce(g)\n"
     "        g /= world_size\n",
     "every gradient is unchanged, this rank's own, although average_gradients called "
     "dist.all_reduce 8 time(s): it reduced a temporary copy"),
    ("    pass\n", "every gradient is unchanged, this rank's own: average_gradients never called "
                 "dist.all_reduce"),
    ("    for p in list(model.parameters())[:2]:\n        dist.all_reduce(p.grad)\n"
     "        p.grad /= world_size\n",
     "2 of the 8 parameters' gradients hold the mean, the other 6 do not.\n"),
])
def test_average_gradients_names_the_mistake_by_its_effect(fresh_lab, body, words):
    fresh_lab.run_cell("def average_gradients(model):\n" + body)
    message = fails(ddplab.check.average_gradients)
    assert message.startswith("after average_gradients(model), " + words), message   # the mistake first
    assert ("\nThe weights after 5 SGD steps are not DDP's on ranks 0, 1 (largest difference "
            in message), message
    assert "\nHint: " in message and "expected True" not in message


def test_average_gradients_flat_accepts_one_flat_all_reduce(fresh_lab, capsys):
    fresh_lab.run_cell(FLAT)
    ddplab.check.average_gradients_flat()
    assert capsys.readouterr().out == \
        "Correct: one flat all_reduce per step gives DDP's weights after 5 steps, on every rank.\n"


def test_average_gradients_flat_rejects_one_all_reduce_per_parameter(fresh_lab):
    fresh_lab.run_cell(PER_PARAMETER.replace("average_gradients(", "average_gradients_flat("))
    message = fails(ddplab.check.average_gradients_flat)
    assert message.startswith("8 all_reduce calls per step on ranks 0, 1: no fewer than the model's 8 "
                              "parameters, so the gradients were not reduced as one flat tensor."), message


def test_average_gradients_flat_rejects_forgetting_to_copy_back(fresh_lab):
    fresh_lab.run_cell(FLAT.replace("        g.copy_(flat[offset:offset + g.numel()].view_as(g))\n", ""))
    with pytest.raises(AssertionError, match="every gradient is unchanged, this rank's own, although "
                                             "average_gradients_flat called dist.all_reduce 1 "
                                             "time.s.: it reduced a temporary copy"):
        ddplab.check.average_gradients_flat()


def test_average_gradients_flat_names_a_missing_division(fresh_lab):
    fresh_lab.run_cell(FLAT.replace("    flat /= world_size\n", ""))
    with pytest.raises(AssertionError, match="^after average_gradients_flat.model., every gradient "
                                             "holds the sum over the 2 ranks"):
        ddplab.check.average_gradients_flat()


def test_a_missing_function_and_a_hang_are_named(fresh_lab):
    fresh_lab.run_cell("average_gradients = None")
    with pytest.raises(AssertionError, match="no function `average_gradients` on ranks 0, 1"):
        ddplab.check.average_gradients()
    fresh_lab.run_cell("def average_gradients(model):\n    if rank == 0:\n"
                       "        dist.all_reduce(next(model.parameters()).grad)\n")
    with pytest.raises(AssertionError, match="did not finish: the ranks are waiting for each other"):
        ddplab.check.average_gradients(timeout=5)       # the default, 15 s, ends it the same way


@pytest.mark.parametrize("change, words", [
    (("    flat /= world_size\n", ""),
     "every gradient holds the sum over the 2 ranks, world_size times the mean: the all_reduce is "
     "there, the division is missing"),
    (("    flat /= world_size\n", "    flat /= 4\n"),
     "every gradient is the mean times 0.5: the sum was divided by 4, not by world_size = 2"),
    (("g.copy_(flat[offset:offset + g.numel()].view_as(g))", "pass"),
     "every gradient is unchanged, this rank's own, although average_gradients_flat called "
     "dist.all_reduce"),
])
def test_average_gradients_flat_names_the_mistake_by_its_effect(fresh_lab, change, words):
    """The flat buffer is a new tensor: not copying it back leaves the gradients unchanged."""
    old, new = change
    assert old in FLAT
    fresh_lab.run_cell(FLAT.replace(old, new))
    message = fails(ddplab.check.average_gradients_flat)
    assert message.startswith("after average_gradients_flat(model), " + words), message
    assert "expected True" not in message


def test_average_gradients_flat_is_not_fooled_by_flooding_the_recorder(fresh_lab):
    """Enough other collectives in a step push its all_reduces out of the recorder: the count is
    unknown then, and an unknown count is not "fewer than the parameters"."""
    fresh_lab.run_cell(FLAT + "    for _ in range(300):\n        dist.barrier()\n")
    with pytest.raises(AssertionError, match="^more than 256 all_reduce calls per step on ranks 0, 1"):
        ddplab.check.average_gradients_flat()


# Submissions that earn the point without averaging anything (issue 46): each passed while the
# check computed its verdict on the ranks, from inputs any rank could compute.
PATCHED_ITEM = """
def average_gradients(model):
    # The check measured its gap on the rank with .item(): make every .item() say 0.
    import torch
    if not hasattr(torch.Tensor, "real_item"):
        torch.Tensor.real_item = torch.Tensor.item
    torch.Tensor.item = lambda self: 0.0
"""

RECOMPUTED_INPUT = """
steps_seen = {}

def average_gradients(model):
    # No communication: every rank's rows of the step were known, so compute the whole batch's
    # gradient here.
    import torch
    import torch.nn.functional as F
    from ddplab import data
    step = steps_seen[id(model)] = (steps_seen.get(id(model), -1) + 1) % 5
    train_set, _ = data.digits(dtype=torch.float64)
    x, y = train_set[step * world_size * 8:(step + 1) * world_size * 8]
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(F.cross_entropy(model(x), y), params)):
        p.grad.copy_(g)
"""


def test_a_patch_of_torch_on_the_ranks_does_not_pass(fresh_lab):
    fresh_lab.run_cell(PATCHED_ITEM)
    try:
        with pytest.raises(AssertionError, match="are not DDP's on ranks 0, 1"):
            ddplab.check.average_gradients()
    finally:
        fresh_lab.run_cell("if hasattr(torch.Tensor, 'real_item'):\n"
                           "    torch.Tensor.item = torch.Tensor.real_item\n")


def test_gradients_computed_from_rows_a_rank_could_guess_do_not_pass(fresh_lab):
    fresh_lab.run_cell(RECOMPUTED_INPUT)
    with pytest.raises(AssertionError, match="are not DDP's on ranks 0, 1"):
        ddplab.check.average_gradients()


def test_average_gradients_flat_counts_all_reduces_under_any_name(fresh_lab):
    """One all_reduce per parameter through an alias is still one per parameter: the count comes
    from torch's flight recorder (patching dist.all_reduce counted none of these, and passed)."""
    fresh_lab.run_cell("from torch.distributed import all_reduce as reduce\n"
                       + PER_PARAMETER.replace("average_gradients(", "average_gradients_flat(")
                       .replace("dist.all_reduce(p.grad)", "reduce(p.grad)"))
    with pytest.raises(AssertionError, match="^8 all_reduce calls per step on ranks 0, 1"):
        ddplab.check.average_gradients_flat()
