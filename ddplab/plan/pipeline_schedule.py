"""Pipeline schedules: which layers a pipeline rank holds, how many micro-batches' activations
it keeps alive, and the bubble.

    layers_of(config, strategy, rank)       # [0, 8, 9, ...]: rank 0's blocks (its stages')
    in_flight(strategy, microbatches, 0)    # 8: rank 0's peak of forwards not yet backwarded
    bubble(strategy, microbatches)          # (P-1)/(V·M) of the compute

``ppP`` runs torch's ``Schedule1F1B`` on P stages, one per rank; ``ppPvV`` runs
``ScheduleInterleaved1F1B`` on P·V stages, V per rank (rank r holds stages r, r+P,
r+2P, ...), as torchtitan's "Interleaved 1F1B". The layers are split as torchtitan
splits them (``ddplab.plan.modules.bounds``), so 126 layers on 16 stages give the
first and last 7 and the others 8.

How many micro-batches' activations a rank holds at once is read off torch's own
schedule: the order of forwards and backwards that ``ScheduleInterleaved1F1B``
computes for each rank (its ``_calculate_single_rank_operations``), walked to the
most forwards whose backward has not run yet (each one stage's layers on one
micro-batch). Under 1F1B the first rank holds min(P, M), the last one.

The bubble (time a rank idles while the pipeline fills and drains) is
(P-1)/(V·M) of the compute: Megatron-LM's interleaved schedule (Narayanan et al.
2021), 1F1B's (P-1)/M when V = 1.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .modules import bounds

__all__ = ["bubble", "in_flight", "layers_of"]


def layers_of(layers: int, pp: int, virtual: int, rank: int) -> list[int]:
    """The blocks pipeline rank ``rank`` holds: those of its stages rank, rank+P, ..."""
    spans = bounds(layers, pp * virtual)
    return [i for s in range(rank, pp * virtual, pp) for i in range(*spans[s])]


def in_flight(pp: int, virtual: int, microbatches: int, rank: int) -> float:
    """The most stage-forwards rank ``rank`` holds the activations of at once, in units of
    one whole rank's layers on one micro-batch (a stage-forward is 1/V of that)."""
    if pp == 1:
        return 1.0
    if virtual == 1:                                     # Schedule1F1B's warmup, then 1F1B
        return float(min(microbatches, pp - rank))
    order = _interleaved_order(pp, virtual, microbatches, rank)
    held = most = 0
    for action in order:
        if action is None:
            continue
        kind = str(getattr(action, "computation_type", ""))
        if kind.endswith("FORWARD") and "BACKWARD" not in kind:
            held += 1
            most = max(most, held)
        elif "BACKWARD" in kind:
            held -= 1
    return most / virtual


def bubble(pp: int, virtual: int, microbatches: int) -> float:
    """The bubble as a share of the compute: (P-1)/(V·M)."""
    return (pp - 1) / (virtual * microbatches) if pp > 1 else 0.0


def _interleaved_order(pp: int, virtual: int, microbatches: int, rank: int) -> list[Any]:
    """Rank ``rank``'s actions in torch's ``ScheduleInterleaved1F1B``, computed by torch's own
    method on the attributes it reads (no stages, no process group needed)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, microbatches // pp)
    fields: dict[str, Any] = {"n_local_stages": virtual, "pp_group_size": pp,
                              "microbatches_per_round": microbatches // rounds,
                              "_n_microbatches": microbatches}
    return ScheduleInterleaved1F1B._calculate_single_rank_operations(SimpleNamespace(**fields), rank)
