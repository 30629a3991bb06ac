"""Checker for notebook 02, collectives: ``global_mean``, a mean over every sample of every rank.

    ddplab.check.global_mean()      # the student's %%ranks function, on inputs drawn here

See ``_named`` for how the function is found and called on each rank.
"""

from __future__ import annotations

from typing import Any

from . import _named as named
from ._core import checker, compare, passed

__all__ = ["global_mean"]


# ---------------------------------------------------------------- global_mean
@checker
def global_mean(lab: Any = None, timeout: float = named.CHECK_TIMEOUT) -> None:
    """Check ``global_mean(losses)``: every rank gets the mean over *all samples* of all ranks.

    ``losses`` is a 1-D float tensor of per-sample values whose length differs
    from rank to rank (a short last batch; a rank with no sample at all). The
    answer is that one number (a Python float or a one-element tensor);
    ``losses`` must stay as it was. The reference is ``torch.cat(inputs).mean()``,
    which the mean of the ranks' means is not.
    """
    import torch

    n = lab.world_size
    # Lengths that differ per rank, so that the mean of means is wrong; then one rank with none.
    for lengths in ([1 + 2 * r for r in range(n)], [3] * (n - 1) + [0]):
        generator = named.draw()
        inputs = [named.integers(generator, rank, (length,)) for rank, length in enumerate(lengths)]
        got = named.answers("global_mean", inputs, lab, timeout)
        expected = torch.cat(inputs).mean().item()
        what = f"global_mean(losses) with losses = {named.said(inputs)}"
        compare(what, [expected] * n, [named.plain(answer) for answer, _ in got], atol=1e-4,
                hint="the mean of the ranks' means counts a short batch as much as a full one. "
                     "all_reduce two numbers, this rank's sum of losses and its number of samples "
                     "(one tensor, on a copy), then divide the total sum by the total count.")
        compare("losses after global_mean(losses)", inputs, [x for _, x in got],
                hint="all_reduce works in place: reduce a new tensor, so the caller's losses "
                     "keep this rank's own values.")
    passed("global_mean(losses) gives every rank the mean over all samples, and leaves losses alone.")
