"""Checker for notebook 00, the set-up: a first collective.

    ddplab.check.mean_score()          # `mean_score` on every rank: the mean of all ranks' scores

Its table shows what each rank holds, never the mean itself (a number the
student must produce: a copied number would pass); in its place it says what
the mean is of. The usual mistakes are named: the mean of the ranks' means,
and each rank's own mean (no collective at all).
"""

from __future__ import annotations

from typing import Any

from ._core import checker, compare, passed, same, values_on_ranks

__all__ = ["mean_score", "scores_of"]


def scores_of(rank: int):
    """The scores notebook 00 gives rank ``rank``: ``2 + 2 * rank`` of them, 1, 2, 3, ...

    Ranks hold different numbers of scores, so the mean of the ranks' own
    means is not the mean of all scores.
    """
    import torch
    return torch.arange(1.0, 3.0 + 2 * rank)


_HINT = ("every rank holds a different number of scores, so the mean of the ranks' means is not the "
         "answer. all_reduce two sums instead: of the scores, and of how many there are; then divide. "
         "(ReduceOp.AVG would weigh every rank the same, whatever its number of scores.)")


@checker
def mean_score(lab: Any = None) -> None:
    """Check ``mean_score`` on every rank: the mean of every rank's ``scores_of(rank)``.

    A float tensor of one element; the same value on every rank.
    """
    import torch

    got = values_on_ranks("mean_score", lab)
    n = lab.world_size
    every = torch.cat([scores_of(rank) for rank in range(n)])
    expected = [every.mean().reshape(1)] * n
    got = [g.reshape(1) if isinstance(g, torch.Tensor) and g.numel() == 1 else g for g in got]
    means = [scores_of(rank).mean().reshape(1) for rank in range(n)]
    mistake = ""
    if all(same(torch.stack(means).mean(0), g, 1e-5) for g in got):
        mistake = "holds the mean of the ranks' means, not the mean of all scores,"
    elif all(same(m, g, 1e-5) for m, g in zip(means, got)):
        mistake = "holds the rank's own mean only (nothing was reduced across ranks)"
    compare("mean_score", expected, got, atol=1e-5, hint=_HINT, mistake=mistake,
            show_expected=f"the mean of all {len(every)} scores of the {n} ranks")
    passed(f"every rank holds the mean of all {len(every)} scores of the {n} ranks.")
