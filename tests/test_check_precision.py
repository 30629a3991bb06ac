"""Checkers of notebook 11 (memory and precision): each accepts the right answer and names each mistake.

The student's code runs on the ranks of a real 2-rank gloo lab, defined by a
%%ranks-like cell (``lab.run_cell``) as the notebook's exercise cells define it.
"""

from __future__ import annotations

import pytest
from conftest import fails, last_line

import ddplab

pytestmark = pytest.mark.slow

IMPORTS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
"""


def test_saved_bytes_counts_activations_once_and_not_parameters():
    import torch

    from ddplab import memory

    model = memory.deep_mlp(depth=2, width=8)
    x = torch.rand(3, 1, 8, 8)
    # flattened input 3x64, then per block the wide ReLU output 3x32 and the block output 3x8,
    # plus the input layer's output 3x8; float32
    assert memory.saved_bytes(lambda: model(x).sum(), model) == 4 * (3 * 64 + 3 * 8 + 2 * (3 * 32 + 3 * 8))


def test_cuda_peak_on_a_machine_without_a_gpu_says_what_works_instead():
    import torch

    from ddplab import memory

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_cuda_peak_holds_at_least_the_saved_activations runs")
    with pytest.raises(RuntimeError, match="sees no CUDA GPU here. memory.saved_bytes counts"):
        memory.cuda_peak(lambda: None)


@pytest.mark.gpu
def test_cuda_peak_holds_at_least_the_saved_activations():
    import torch

    from ddplab import memory

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = memory.deep_mlp(depth=4, width=256).cuda()
    x = torch.rand(512, 1, 8, 8, device="cuda")
    saved = memory.saved_bytes(lambda: model(x).sum(), model)
    peak = memory.cuda_peak(lambda: model(x).sum())
    # the activations (less the batch, allocated before the call, which saved_bytes counts
    # as the first layer's input), plus the output and the temporaries; not the parameters
    batch = x.numel() * x.element_size()
    assert saved - batch <= peak < saved + 8 * 2**20, (saved, peak)


# ----------------------------------------------------------- checkpoint_blocks
CKPT = IMPORTS + """
def ckpt_forward(model, x):
    h = model[0](x)
    for block in model[1:-1]:
        h = checkpoint(block, h, use_reentrant=False)
    return model[-1](h)
"""


def test_checkpoint_blocks_accepts_per_block_checkpoints(fresh_lab, capsys):
    fresh_lab.run_cell(CKPT)
    ddplab.check.checkpoint_blocks()
    assert last_line(capsys).startswith("Correct: each block is recomputed in backward")


@pytest.mark.parametrize("edit,needle", [
    (("h = checkpoint(block, h, use_reentrant=False)", "h = block(h)"),
     "as much as without checkpointing"),
    (("    h = model[0](x)\n    for block in model[1:-1]:\n"
      "        h = checkpoint(block, h, use_reentrant=False)\n    return model[-1](h)",
      "    return checkpoint(model, x, use_reentrant=False)"),
     "not several blocks (or the whole model)"),
    (("return model[-1](h)", "return model[-1](h).detach()"), "no torch.no_grad(), no .detach()"),
    (("for block in model[1:-1]:", "for block in model[1:-2]:"),
     "equals model(x) (deep_mlp(depth=2)): not so"),
])
def test_checkpoint_blocks_rejects(fresh_lab, edit, needle):
    source = CKPT.replace(*edit)
    assert source != CKPT
    fresh_lab.run_cell(source)
    fails(ddplab.check.checkpoint_blocks, needle)


def test_checkpoint_blocks_names_a_missing_function(fresh_lab):
    fresh_lab.run_cell("ckpt_forward = None")
    fails(ddplab.check.checkpoint_blocks, "no function `ckpt_forward` on ranks 0, 1")


# ------------------------------------------------------------------ mixed_step
MIXED = IMPORTS + """
def mixed_step(model, optimizer, x, y):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
"""


def test_mixed_step_accepts_autocast_with_fp32_weights(fresh_lab, capsys):
    fresh_lab.run_cell(MIXED)
    ddplab.check.mixed_step()
    assert last_line(capsys).startswith("Correct: the forward ran in bfloat16 under autocast")


@pytest.mark.parametrize("edit,needle", [
    (("    optimizer.zero_grad()\n",
      "    model.to(torch.bfloat16); x = x.bfloat16()\n    optimizer.zero_grad()\n"),
     "do not call model.to(torch.bfloat16)"),
    (('with torch.autocast("cpu", dtype=torch.bfloat16):', "if True:"), "under autocast to bfloat16"),
    (("    optimizer.step()\n", ""), "the step changed the weights: not so"),
    (("return loss.item()", "return loss"), "returns the loss as a Python float: not so"),
])
def test_mixed_step_rejects(fresh_lab, edit, needle):
    source = MIXED.replace(*edit)
    assert source != MIXED
    fresh_lab.run_cell(source)
    fails(ddplab.check.mixed_step, needle)


# Issue 46: the checker took torch's autocast step on the rank, in the frame that called the
# student's function; its weights and loss, read from there, passed without a step of one's own.
MIXED_FROM_THE_FRAME = IMPORTS + """
def mixed_step(model, optimizer, x, y):
    import sys
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)                                      # the Linear outputs the check looks at
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    there = sys._getframe(1).f_locals
    if "reference" not in there:
        return 0.0
    for p, q in zip(model.parameters(), there["reference"].parameters()):
        p.data.copy_(q.data)
    return there["loss"].item()
"""


def test_mixed_step_read_from_the_checkers_frame_does_not_pass(fresh_lab):
    fresh_lab.run_cell(MIXED_FROM_THE_FRAME)
    fails(ddplab.check.mixed_step, "on ranks 0, 1.")


# ------------------------------------------------------------------- bf16_hook
HOOK = IMPORTS + """
def bf16_hook(state, bucket):
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer = bucket.buffer()
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)
"""


def test_bf16_hook_accepts_a_compressing_hook(fresh_lab, capsys):
    fresh_lab.run_cell(HOOK)
    ddplab.check.bf16_hook()
    assert last_line(capsys).startswith("Correct: the hook all_reduces each bucket in bfloat16")


@pytest.mark.parametrize("edit,needle", [
    ((".to(torch.bfloat16)", ".clone()"), "a bfloat16 copy of the bucket's buffer"),
    ((".div_(dist.get_world_size())", ""), "divide by the world size (2)"),
])
def test_bf16_hook_rejects(fresh_lab, edit, needle):
    fresh_lab.run_cell(HOOK.replace(*edit))
    fails(ddplab.check.bf16_hook, needle)


def test_bf16_hook_refuses_torchs_own_hook_under_another_name(fresh_lab):
    """The bypass: a one-line wrapper around torch's bf16_compress_hook (registered by its own name,
    torch refuses it on a CPU build; under another name it runs, on gloo too)."""
    fresh_lab.run_cell(IMPORTS + """
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

def bf16_hook(state, bucket):
    return default_hooks.bf16_compress_hook(state, bucket)
""")
    fails(ddplab.check.bf16_hook, "may not use torch's compression hooks")


# ------------------------------------------------------------------ accumulate
ACCUMULATE = IMPORTS + """
def accumulate(ddp, optimizer, batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(batches):
        if i < len(batches) - 1:
            with ddp.no_sync():
                (F.cross_entropy(ddp(x), y) / len(batches)).backward()
        else:
            (F.cross_entropy(ddp(x), y) / len(batches)).backward()
    optimizer.step()
"""
# The classic slip: no_sync around backward only. DDP decides in forward whether backward all_reduces.
BACKWARD_ONLY = ACCUMULATE.replace(
    """            with ddp.no_sync():
                (F.cross_entropy(ddp(x), y) / len(batches)).backward()""",
    """            loss = F.cross_entropy(ddp(x), y) / len(batches)
            with ddp.no_sync():
                loss.backward()""")


def test_accumulate_accepts_no_sync(fresh_lab, capsys):
    fresh_lab.run_cell(ACCUMULATE)
    ddplab.check.accumulate()
    assert last_line(capsys).startswith("Correct: 4 micro-batches, one round of all_reduce")


@pytest.mark.parametrize("edit,needle", [
    (("if i < len(batches) - 1:", "if False:"), "every one of the 4 backwards all_reduced"),
    (("/ len(batches)", "/ 1"), "your gradients are 4.00× the expected: you summed over the 4"),
    (("/ len(batches)", "/ len(batches) ** 2"), "0.25× the expected: the mean was taken twice"),
    (("    for i, (x, y) in enumerate(batches):\n", "    for i, (x, y) in enumerate(batches):\n"
      "        optimizer.zero_grad()\n"), "not a multiple of the expected one"),
    (("    optimizer.step()\n", ""), "the weights did not move"),
])
def test_accumulate_rejects(fresh_lab, edit, needle):
    source = ACCUMULATE.replace(*edit)
    assert source != ACCUMULATE
    fresh_lab.run_cell(source)
    fails(ddplab.check.accumulate, needle)


def test_accumulate_rejects_one_backward_over_all_micro_batches(fresh_lab):
    """The bypass: the micro-batches concatenated, one forward and one backward (one all_reduce, the
    same weights), which is one larger batch, not accumulation."""
    fresh_lab.run_cell(IMPORTS + """
def accumulate(ddp, optimizer, batches):
    optimizer.zero_grad()
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()
""")
    fails(ddplab.check.accumulate, "backward passes", "a forward and a backward per micro-batch")


def test_accumulate_rejects_no_sync_around_backward_only(fresh_lab):
    assert BACKWARD_ONLY != ACCUMULATE
    fresh_lab.run_cell(BACKWARD_ONLY)
    fails(ddplab.check.accumulate, "every one of the 4 backwards all_reduced", "the forward too")


# ---------------------------------------------------------------- clip_sharded
CLIP = IMPORTS + """
def clip_sharded(model, max_norm):
    shards = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    total = torch.stack([(g * g).sum() for g in shards]).sum()
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in shards:
        g.mul_(coef)
    return norm.item()
"""


def test_clip_sharded_accepts_one_all_reduce_of_the_squares(fresh_lab, capsys):
    fresh_lab.run_cell(CLIP)
    ddplab.check.clip_sharded()
    assert last_line(capsys).startswith("Correct: clip_sharded computes the global norm")


@pytest.mark.parametrize("edit,needle", [
    (("    dist.all_reduce(total)\n", ""), "not one per parameter, and not none"),
    (("    total = torch.stack([(g * g).sum() for g in shards]).sum()\n    dist.all_reduce(total)\n"
      "    norm = total.sqrt()\n",
      "    norm = torch.stack([(g * g).sum() for g in shards]).sum().sqrt()\n    dist.all_reduce(norm)\n"),
     "norms do not add up"),
    # the shortcut: torch's own, which reduces across the shards itself
    (("    shards = [", "    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()\n"
                     "    shards = ["), "may not use clip_grad_norm_"),
    (("    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)\n", "    coef = max_norm / (norm + 1e-6)\n"),
     "the coefficient is clamped to 1"),
])
def test_clip_sharded_rejects(fresh_lab, edit, needle):
    source = CLIP.replace(*edit)
    assert source != CLIP
    fresh_lab.run_cell(source)
    fails(ddplab.check.clip_sharded, needle)


def test_clip_sharded_counts_an_all_reduce_imported_under_another_name(fresh_lab, capsys):
    fresh_lab.run_cell(CLIP.replace("    dist.all_reduce(total)\n", "    reduce_all(total)\n")
                       + "from torch.distributed import all_reduce as reduce_all\n")
    ddplab.check.clip_sharded()
    assert last_line(capsys).startswith("Correct: clip_sharded computes the global norm")


def test_clip_sharded_names_a_norm_of_one_shard_by_its_ratio(fresh_lab):
    """Each rank's own norm, no all_reduce: the check's one count fails first, so count it away."""
    fresh_lab.run_cell(CLIP.replace("    dist.all_reduce(total)\n", "    dist.all_reduce(total * 0)\n"))
    fails(ddplab.check.clip_sharded, "the global one: it is one shard's only")


def test_clip_sharded_read_from_the_checkers_frame_does_not_pass(fresh_lab):
    """Issue 46: the check clipped a one-process model on the rank before calling the student's
    function, in its frame; its norm and gradients read from there, with an all_reduce for show,
    passed."""
    fresh_lab.run_cell(IMPORTS + """
import sys

def clip_sharded(model, max_norm):
    dist.all_reduce(torch.zeros(1, dtype=torch.float64))
    frame = sys._getframe(1)
    while frame is not None and "expected" not in frame.f_locals:
        frame = frame.f_back
    if frame is None:
        return 0.0
    seen = frame.f_locals
    for p, q in zip(model.parameters(), seen["one"].parameters()):
        p.grad.to_local().copy_(q.grad.chunk(dist.get_world_size())[dist.get_rank()])
    return seen["expected"]
""")
    fails(ddplab.check.clip_sharded, "on ranks 0, 1.")
