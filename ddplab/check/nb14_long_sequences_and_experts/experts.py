"""Checkers for notebook 14, experts: dispatch and combine by all_to_all, the balance loss.

    ddplab.check.moe_layer(my_moe_layer)          # tokens to their experts' ranks and back
    ddplab.check.balance_loss(my_balance_loss)    # the auxiliary loss over every rank's tokens

``moe_layer`` runs ``fn(x, idx, gates, experts)`` on every rank (its own tokens,
their top-2 experts, ``-1`` where capacity dropped one, and a dict of the experts
it holds) twice, once with dropped assignments, and compares each rank's output
with ``ddplab.moe.reference`` on one process (float64, 1e-10). Every
``all_to_all_single`` is watched: before it runs, the check exchanges the split
sizes itself, and if a rank expects other sizes than its peers send (sizes not
exchanged first), every rank fails with that message; there must be a dispatch
and a combine of token rows. Other collectives and send/recv raise. A wrong
output is matched against tokens combined out of order and gates not applied.

``balance_loss`` runs ``fn(probs, idx)`` on ranks with differently routed
tokens; every rank must return the loss of all tokens together, matched
against the loss of the rank's own tokens only, the ranks' losses averaged, and
the fraction not divided by k. Only ``all_reduce`` may move data.

Both draw the tokens (and ``moe_layer`` the experts' weights) for each check
from seeds no rank sees, and send each rank only its own tokens and experts
(``Lab.run_each``); the outputs come back and are compared here, with the
checker's torch. A rank can know another's tokens or experts only by communicating.
"""

from __future__ import annotations

from typing import Any, Callable

from .._core import FLOAT32_HINT, checker, passed, run_on_ranks, run_student_code, same
from .._feedback import Feedback, Row, float32_rounding, spell_against
from .._forbid import COLLECTIVES, forbidding
from .._peers import swap_peer_calls
from ._ring import raise_refusal, refused, warm

__all__ = ["balance_loss", "moe_layer"]

TIMEOUT = 15.0
WARM_UP = 120.0          # the check's own warm-up on fresh ranks of a loaded machine
DIM, K, ATOL = 6, 2, 1e-10


def _case(rank: int, world: int, capacity: bool, seed: int) -> tuple:
    """Rank ``rank``'s tokens (from ``seed``) and their routing, ``(x, idx, gates)``; 2 experts per rank."""
    from ddplab import moe

    experts = 2 * world
    x = moe.tokens(6 + 2 * rank, DIM, seed=seed)
    idx, gates, _ = moe.Router(DIM, experts, seed=5, skew=1.5)(x, K)
    if capacity:
        idx = moe.drop(idx, moe.capacity_keep(idx, experts, moe.capacity(len(x), K, experts, 1.0)))
    return x, idx.detach(), gates.detach()


def _sizes(sizes: Any, rows: int, world: int) -> list[int] | None:
    if sizes is None:
        return [rows // world] * world if rows % world == 0 else None
    return [int(n) for n in sizes]


def _watched(real: Callable, log: list, exercise: str) -> Callable:
    """``all_to_all_single`` that first checks, on every rank, that the split sizes agree."""
    import inspect

    import torch
    import torch.distributed as dist

    signature = inspect.signature(real)

    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        out, inp = given["output"], given["input"]
        rank, world = dist.get_rank(), dist.get_world_size()
        sends = _sizes(given.get("input_split_sizes"), inp.size(0), world)
        expects = _sizes(given.get("output_split_sizes"), out.size(0), world)
        theirs = torch.empty(world, dtype=torch.long)
        real(theirs, torch.tensor(sends or [-1] * world, dtype=torch.long))
        bad = sends is None or expects is None or theirs.tolist() != expects
        verdicts = torch.empty(world, dtype=torch.long)
        real(verdicts, torch.full((world,), int(bad), dtype=torch.long))
        log.append((inp.dtype.is_floating_point, sends, expects))
        if verdicts.any():
            mine = (f"rank {rank} expected {expects} rows from ranks 0..{world - 1}, which send it "
                    f"{theirs.tolist()}" if bad else
                    f"rank(s) {[r for r, v in enumerate(verdicts.tolist()) if v]} expected other "
                    f"numbers of rows than their peers send")
            raise Feedback(
                f"{exercise}: split sizes not exchanged: {mine}.",
                hint="a rank cannot know how many tokens the others route to its experts: exchange "
                     "the counts first (an all_to_all_single of one count per rank), and pass them "
                     "as output_split_sizes.")
        return real(*args, **kwargs)
    return call


def _no_p2p(exercise: str) -> Callable[[], None]:
    def refuse(name: str, keyword: str, real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise Feedback(f"{exercise}: dist.{name} is not how tokens travel here.",
                           hint="use the collective the exercise names.")
        return call
    return swap_peer_calls(refuse)


def _drawn_experts(num: int) -> list:
    """``moe.experts(num, DIM)`` with weights drawn now from a seed no rank sees.

    ``moe.experts`` seeds each expert by its index, so any rank could make
    every expert; these a rank holds only if the checker sent them to it.
    """
    import secrets

    import torch

    from ddplab import moe

    generator = torch.Generator().manual_seed(secrets.randbits(62))
    everyone = moe.experts(num, DIM)
    with torch.no_grad():
        for p in (p for expert in everyone for p in expert.parameters()):
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return everyone


def _layer_run(fn: Callable, x: Any, idx: Any, gates: Any, mine: dict) -> dict:
    """On a rank: the student's layer on this rank's tokens, with every all_to_all_single watched.

    The tokens, their routing and this rank's experts were drawn by the checker
    and sent to this rank alone: another rank's tokens or experts it learns
    only by communicating, and the checker compares the output in its own process.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    log: list = []
    real = dist.all_to_all_single
    watched = _watched(real, log, "moe_layer")
    undo = _no_p2p("moe_layer")
    for module in (dist, c10d):
        module.all_to_all_single = watched
    others = tuple(c for c in COLLECTIVES if c != "all_to_all")
    try:
        with forbidding(others, "moe_layer", "expert parallelism's dispatch and combine"):
            out, said = refused(lambda: fn(x.clone(), idx.clone(), gates.clone(), mine))
    finally:
        undo()
        for module in (dist, c10d):
            module.all_to_all_single = real
    dist.barrier()
    return {"out": out.detach().clone() if isinstance(out, torch.Tensor) else out, "log": log,
            "refused": said}


def _out_of_order(x: Any, idx: Any, gates: Any, everyone: list) -> list:
    """The outputs of a combine that puts the returned rows back in the wrong order.

    The rows come back in dispatch order (sorted by expert); left so, or sent
    through the sort's permutation instead of its inverse, each token sums
    another assignment's expert output.
    """
    import torch

    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] >= 0]
    with torch.no_grad():
        rows = torch.stack([everyone[int(flat[a])].net(x[a // K]) for a in order.tolist()]) \
            if len(order) else x.new_zeros(0, x.shape[1])
    wrong = []
    for placed in (rows, rows[order] if len(order) == len(flat) else None):
        if placed is not None:
            y = x.new_zeros(len(flat), x.shape[1])
            y[:len(placed)] = placed
            wrong.append((y * gates.reshape(-1, 1)).view(len(x), K, -1).sum(1))
    return wrong


@checker
def moe_layer(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(x, idx, gates, experts)``: an expert-parallel MoE layer equal to one process's."""
    __tracebackhide__ = True
    import secrets

    import torch

    from ddplab import moe

    if not callable(fn):
        raise Feedback(f"ddplab.check.moe_layer needs your function; got {fn!r}.",
                       hint="pass it, as in ddplab.check.moe_layer(my_moe_layer).")
    p = lab.world_size
    everyone = _drawn_experts(2 * p)
    run_on_ranks(warm, lab=lab, timeout=WARM_UP)
    for capacity in (False, True):
        cases = [_case(rank, p, capacity, secrets.randbits(40)) for rank in range(p)]
        own = {rank: (*cases[rank], {e: everyone[e] for e in moe.local(rank, 2 * p, p)})
               for rank in range(p)}
        got = run_student_code("moe_layer(x, idx, gates, experts)", _layer_run, fn, lab=lab, each=own,
                               timeout=TIMEOUT, hint="every rank must make the same all_to_all calls.")
        got = [got[rank] for rank in range(p)]
        raise_refusal(got)
        moved = [sum(1 for floating, _, _ in g["log"] if floating) for g in got]
        if min(moved) < 2:
            raise Feedback(f"moe_layer: {min(moved)} all_to_all_single call(s) of token rows on some "
                           f"rank; a layer needs two.",
                           hint="dispatch the rows to their experts' ranks with one all_to_all_single "
                                "and bring the results back with another.")
        for rank, g in enumerate(got):
            x, idx, gates = cases[rank]
            expected = moe.reference(x, idx, gates, everyone)
            mine = g["out"]
            if same(expected, mine, ATOL):
                continue
            said = (f"moe_layer{' with dropped assignments' if capacity else ''}: rank {rank}'s "
                    f"output is not one process's MoE on its tokens (float64, {ATOL:g})")
            rows = [Row(rank, spell_against(expected, mine), wrong=True)]
            if float32_rounding(expected, mine):
                raise Feedback(f"{said}, only to float32's rounding: your code computes in float32 "
                               f"somewhere.", rows=rows, hint=FLOAT32_HINT)
            unweighted = moe.reference(x, idx, torch.ones_like(gates), everyone)
            if same(unweighted, mine, ATOL):
                why = "the gates were not applied: weight each expert's output by its gate"
            elif any(same(wrong, mine, ATOL) for wrong in _out_of_order(x, idx, gates, everyone)):
                why = ("tokens combined out of order: every row is a token's right output, at "
                       "another token's place. Put each returned row back where it was sorted from "
                       "(the inverse of the dispatch order) before summing over k")
            else:
                why = ("sort the assignments by expert, send each rank the rows of its experts, run "
                       "each expert on its rows, send them back, undo the sort, and sum each token's "
                       "k outputs weighted by gates; an assignment of -1 was dropped: not sent")
            raise Feedback(f"{said}.", rows=rows, hint=f"{why}.")
    passed(f"moe_layer equals one process's mixture of experts on {p} ranks ({2 * p} experts, top-{K}, "
           f"with and without dropped assignments; float64, {ATOL:g}), the split sizes exchanged "
           f"before the tokens.")


# ----------------------------------------------------------------- balance
def _balance_case(rank: int, world: int, seed: int) -> tuple:
    """Rank ``rank``'s router probabilities and top-k choices, for tokens drawn from ``seed``."""
    from ddplab import moe

    x = moe.tokens(5 + 3 * rank, DIM, seed=seed) + rank   # each rank's tokens lean elsewhere
    idx, _, probs = moe.Router(DIM, 2 * world, seed=5)(x, K)
    return probs.detach(), idx.detach()


def _loss(probs: Any, idx: Any, k: int = K) -> float:
    """The Switch Transformer's balance loss of these tokens: E * sum_e f_e * P_e."""
    import torch

    experts = probs.shape[1]
    f = torch.bincount(idx.reshape(-1), minlength=experts).to(probs.dtype) / (len(probs) * k)
    return float(experts * (f * probs.mean(0)).sum())


def _balance_run(fn: Callable, probs: Any, idx: Any) -> Any:
    """On a rank: ``fn`` on this rank's ``probs``/``idx``, sent to it alone; only all_reduce moves data."""
    import torch
    import torch.distributed as dist

    undo = _no_p2p("balance_loss")
    others = tuple(c for c in COLLECTIVES if c != "all_reduce")
    try:
        with forbidding(others, "balance_loss", "the balance loss from all_reduced statistics"):
            got, said = refused(lambda: fn(probs.clone(), idx.clone()))
    finally:
        undo()
    dist.barrier()
    value = float(got) if isinstance(got, torch.Tensor) and got.numel() == 1 else got
    return {"value": value, "refused": said}


@checker
def balance_loss(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(probs, idx)``: the balance loss of every rank's tokens together, on every rank."""
    __tracebackhide__ = True
    import secrets

    import torch

    if not callable(fn):
        raise Feedback(f"ddplab.check.balance_loss needs your function; got {fn!r}.",
                       hint="pass it, as in ddplab.check.balance_loss(my_balance_loss).")
    p = lab.world_size
    run_on_ranks(warm, lab=lab, timeout=WARM_UP)
    cases = [_balance_case(rank, p, secrets.randbits(40)) for rank in range(p)]
    got = run_student_code("balance_loss(probs, idx)", _balance_run, fn, lab=lab, timeout=TIMEOUT,
                           hint="every rank must make the same all_reduce calls.",
                           each=dict(enumerate(cases)))
    got = [got[rank] for rank in range(p)]
    raise_refusal(got)
    got = [g["value"] for g in got]
    probs, idx = torch.cat([c[0] for c in cases]), torch.cat([c[1] for c in cases])
    expected = _loss(probs, idx)
    local = [_loss(*c) for c in cases]
    for rank, g in enumerate(got):
        if isinstance(g, float) and abs(g - expected) <= ATOL:
            continue
        if not isinstance(g, float):
            why = f"return one number (a float or a one-element tensor), not {type(g).__name__}"
        elif abs(g - local[rank]) <= ATOL:
            why = "it is the loss of this rank's tokens only: the loss is over every rank's tokens"
        elif abs(g - sum(local) / p) <= ATOL:
            why = ("the ranks' losses were averaged: the mean of products f_e * P_e is not the "
                   "product of the means. all_reduce the counts per expert, the summed "
                   "probabilities and the number of tokens, then form the loss once")
        elif abs(g - K * expected) <= ATOL:
            why = "f_e counts each token k times: divide the counts by tokens x k"
        else:
            why = ("the Switch Transformer's loss, with the routed fractions and the mean "
                   "probabilities measured over every rank's tokens")
        raise Feedback(f"balance_loss on rank {rank} is wrong: got {g!r}, not the loss of all "
                       f"{len(probs)} tokens together (one process, float64, {ATOL:g}).",
                       hint=f"{why}.")
    passed(f"balance_loss gives every rank the loss of all {len(probs)} tokens of its {p} ranks "
           f"together, from all_reduced statistics (float64, {ATOL:g}).")
