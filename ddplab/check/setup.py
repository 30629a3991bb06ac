"""Checkers for the set-up notebooks: 00 (a first collective) and 03 (a group joined by hand).

    ddplab.check.mean_score()          # `mean_score` on every rank: the mean of all ranks' scores
    ddplab.check.tcp_group()           # each rank joined one group over tcp://, by its own prompt

See _core for the shared behaviour: one fixed ``Correct:`` line, or an
AssertionError with what each rank should have had and what it had.
"""

from __future__ import annotations

from typing import Any

from ..text import plural
from ._core import compare, lab_or_current, passed, values_on_ranks

__all__ = ["mean_score", "scores_of", "tcp_group"]


# ------------------------------------------------------------------ mean_score
def scores_of(rank: int):
    """The scores notebook 00 gives rank ``rank``: ``2 + 2 * rank`` of them, 1, 2, 3, ...

    Ranks hold different numbers of scores, so the mean of the ranks' own
    means is not the mean of all scores.
    """
    import torch
    return torch.arange(1.0, 3.0 + 2 * rank)


def mean_score(lab: Any = None) -> None:
    """Check ``mean_score`` on every rank: the mean of every rank's ``scores_of(rank)``.

    A float tensor of one element; the same value on every rank.
    """
    import torch

    lab = lab_or_current(lab)
    got = values_on_ranks("mean_score", lab)
    every = torch.cat([scores_of(rank) for rank in range(lab.world_size)])
    expected = [every.mean().reshape(1)] * lab.world_size
    got = [g.reshape(1) if isinstance(g, torch.Tensor) and g.numel() == 1 else g for g in got]
    compare("mean_score", expected, got, atol=1e-5,
            hint="every rank holds a different number of scores, so the mean of the ranks' "
                 "means is not the answer. all_reduce two sums instead: of the scores, and of "
                 "how many there are; then divide. (ReduceOp.AVG would weigh every rank the same, "
                 "whatever its number of scores.)")
    passed(f"every rank holds the mean of all {len(every)} scores of the {lab.world_size} ranks.")


# ------------------------------------------------------------------ tcp_group
def _group_state() -> dict:
    """On a rank: the state of its default group, as far as the exercise cares."""
    import os

    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        return {"joined": False}
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"joined": True, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "sum": t.item(),
            "env": sorted(k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
                          if k in os.environ)}


def tcp_group(lab: Any = None, timeout: float = 20) -> None:
    """Check that every rank of the lab joined one gloo group over ``tcp://``, with its own rank.

    Reads the default group's state on each rank: joined, rank (the prompt's
    rank), world size (the lab's), an all_reduce across it that works, and
    no MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE in the environment
    (those are env://'s way; tcp:// passes everything in the call).
    """
    from ..errors import HangError
    from ._core import deadlock

    lab = lab_or_current(lab)
    n = lab.world_size
    try:
        states = lab.run(_group_state, timeout=timeout)
    except HangError as exc:
        raise deadlock("the group check (one all_reduce)", exc, timeout,
                       "some ranks are in a group the others are not in: every rank must "
                       "join the same tcp:// address with the same world_size.") from None
    missing = [rank for rank, s in enumerate(states) if not s["joined"]]
    if missing:
        raise AssertionError(
            f"{plural(len(missing), 'rank')} {', '.join(map(str, missing))} "
            f"{'have' if len(missing) > 1 else 'has'} not joined a group "
            f"(dist.is_initialized() is False there). Run that rank's prompt, "
            f"with init_process_group('gloo', init_method=f'tcp://127.0.0.1:{{port}}', "
            f"rank=..., world_size={n}).")
    compare("(rank, world_size) of the group", [(rank, n) for rank in range(n)],
            [(s["rank"], s["world_size"]) for s in states],
            hint=f"the prompt %%rank r passes rank=r, and every prompt passes world_size={n}.")
    total = float(sum(range(n)))
    compare("an all_reduce of the ranks in the group", [total] * n, [s["sum"] for s in states],
            hint="all ranks must join one group at the same tcp:// address.")
    compare("torchrun's variables set in the environment", [[]] * n, [s["env"] for s in states],
            hint="tcp:// needs no environment variables: the address is in the URL, and rank "
                 "and world_size are arguments. Do not set them (that is env://'s way).")
    passed(f"the {n} ranks joined one group over tcp://, each with its own rank.")
