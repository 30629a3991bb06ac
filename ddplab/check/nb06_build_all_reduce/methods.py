"""Checkers for notebook 06: all_reduce built by hand, compared with ``dist.all_reduce``.

    ddplab.check.naive_all_reduce(my_naive_all_reduce)
    ddplab.check.ring_all_reduce(my_ring_all_reduce)

Each takes the student's function, ``fn(tensor)``, which must sum ``tensor``
over all ranks in place, like ``dist.all_reduce(tensor)``. The checker ships
it to every rank (cloudpickle) and, for several lengths (some not divisible
by world_size, one shorter than it, one 2-D) and dtypes, gives it random data
and compares the result with what ``dist.all_reduce`` leaves: the sum of the
inputs. Exercises that build all_reduce from send/recv must not call
collectives: during the student's call those raise.

Where the verdict is made: the inputs are drawn by the checker, from a seed
drawn for each case that no rank sees, and each rank is sent only its own
(``Lab.run_each``); the tensor each rank is left with comes back, and the
checker compares it with the sum, with its own torch. Nothing on a rank holds
the answer or judges it, so a submission that patches torch's comparisons on
its ranks, or reads the checker's frames there, learns nothing and changes
nothing; under ``ddplab grade`` the checker runs in the grading worker, where
the submission's code never ran (``ddplab.grade.witness``).

On failure the ``Feedback`` names the case (shape, dtype, seed), the ranks
that are wrong, and the first wrong element indexes with expected and got:
sums of inputs drawn for this check, never a value to copy. The hints name
the idea of each algorithm, never its index formulas (the notebook's pictures
show those).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from .._core import checker, lab_or_current, passed, run_student_code
from .._feedback import Feedback, Row, ranks_phrase
from .._forbid import COLLECTIVES, forbidding
from .._peers import peer, swap_peer_calls
from ._messages import message_log, ring_problems, tree_depth
from ._reference import refusing_reference

__all__ = [
    "naive_all_reduce",
    "naive_all_reduce_collectives",
    "recursive_doubling_all_reduce",
    "ring_all_reduce",
    "tree_all_reduce",
]

#: Lengths every checker tries: 1 (shorter than world_size), odd, prime, large-ish and uneven.
LENGTHS = (1, 6, 13, 1000, 4099)
DTYPES = ("float32", "float64", "int64", "int32")
SEEDS = (0, 1)
_SHOWN = 6                        # wrong elements listed per rank
#: Seconds one case may take before the ranks are reported as deadlocked (a case takes well under 1 s).
DEADLOCK_TIMEOUT = 15.0
# Said where the lab sees no pattern of its own (all in send, all in recv): nothing about where.
DEADLOCK_HINT = ("check that every send has a matching recv on the rank it names (src/dst), and "
                 "that the order lets one side start: gloo's blocking send returns only once the "
                 "receive is posted.")


def cases(lengths=LENGTHS, dtypes=DTYPES, seeds=SEEDS) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, seed) for every case; one extra 2-D case, since 'any length' means any shape."""
    out = [((n,), dtype, seed) for seed in seeds for dtype in dtypes for n in lengths]
    out.append(((3, 5), "float32", 2))
    return out


def _make(shape: tuple[int, ...], dtype: str, seed: int, rank: int):
    """The input of one case on one rank: different on each rank, the same for the same seed."""
    import torch

    generator = torch.Generator().manual_seed(1000 * seed + rank)
    kind = getattr(torch, dtype)
    if kind.is_floating_point:
        return torch.randn(shape, generator=generator).to(kind)
    return torch.randint(-100, 100, shape, generator=generator).to(kind)


def _wrong_elements(expected, got, atol: float) -> tuple[int, list[tuple[int, Any, Any]]]:
    """How many elements differ, and the first few as (flat index, expected, got)."""
    import torch

    e, g = expected.reshape(-1), got.reshape(-1)
    if e.dtype.is_floating_point:
        bad = ~torch.isclose(g.double(), e.double(), rtol=0, atol=atol)
    else:
        bad = g != e
    where = bad.nonzero().reshape(-1)
    return len(where), [(int(i), e[i].item(), g[i].item()) for i in where[:_SHOWN]]


def _as_world(world: int | None, strays: list[str]):
    """A context manager: on ranks 0..world-1 of a bigger lab, pretend the job has ``world`` ranks.

    ``dist.get_world_size()`` answers ``world``. A send or receive naming a rank
    outside it does nothing (a rank that is not taking part would never answer)
    and is noted in ``strays``, so the verdict can say what went wrong.
    """
    import contextlib

    import torch.distributed as dist

    class _Done:
        def wait(self, *args, **kwargs):
            return True

        def is_completed(self):
            return True

    @contextlib.contextmanager
    def pretend():
        if world is None:
            yield
            return
        real_world_size = dist.get_world_size

        def guarded(name, keyword, real):
            def call(*args, **kwargs):
                other = peer(args, kwargs, keyword)
                if isinstance(other, int) and not 0 <= other < world:
                    strays.append(f"dist.{name}({keyword}={other})")
                    return _Done() if name.startswith("i") else other
                return real(*args, **kwargs)
            return call

        dist.get_world_size = lambda group=None: world if group is None else real_world_size(group)
        undo = swap_peer_calls(guarded)
        try:
            yield
        finally:
            undo()
            dist.get_world_size = real_world_size
    return pretend()


def _on_rank(fn: Callable, forbidden: tuple[str, ...], exercise: str, world: int | None,
             refuse_reference: bool, case: tuple, data) -> dict:
    """On a rank: the student's ``fn`` on this rank's input, ``data`` (sent by the checker to this
    rank alone); what it left in the tensor. Nothing is judged here, where the student's code ran:
    the checker compares, with its own torch (``_judge``).

    With ``world``, only ranks ``0..world-1`` run it, as a job of ``world`` ranks.
    """
    import torch
    import torch.distributed as dist

    got = data.clone()
    strays: list[str] = []
    # What the student's code raises goes on as it is: the check shows it by name and line,
    # with the case (``run_student_code``'s ``what``).
    refusal = refusing_reference(exercise) if refuse_reference else contextlib.nullcontext()
    with forbidding(forbidden, exercise), refusal, _as_world(world, strays):
        returned = fn(got)
    if world is None:
        dist.barrier()                           # cases never overlap on the wire
    return {"got": got, "strays": strays,
            "returned_new": isinstance(returned, torch.Tensor) and returned is not got}


def _judge(case: tuple, sent, left: dict, world: int) -> dict:
    """The verdict on one rank's result, made by the checker: ``sent`` is every taking-part rank's
    input, ``left`` what the rank's tensor held afterwards (``_on_rank``)."""
    import torch

    expected = sum(sent[1:], sent[0].clone())          # what dist.all_reduce leaves
    got = left.get("got") if isinstance(left, dict) else None
    verdict = dict(case=case, count=0, shown=[], note="")
    if not isinstance(got, torch.Tensor):
        return dict(verdict, count=expected.numel() or 1, note="its tensor did not come back")
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return dict(verdict, count=got.numel() or 1,
                    note=f"the tensor changed to shape {list(got.shape)}, {got.dtype}")
    # Floats are summed in another order than gloo's, so allow a few roundings
    # of the largest value (float16 rounds at 1e-3, float32 at 1e-7).
    atol = 0.0
    if expected.dtype.is_floating_point and expected.numel():
        eps = max(1e-6, torch.finfo(expected.dtype).eps * 2 * world)
        atol = eps * max(1.0, float(expected.abs().max()))
    verdict["count"], verdict["shown"] = _wrong_elements(expected, got, atol)
    return verdict


def _run_case(fn: Callable, case: tuple, forbidden: tuple[str, ...], exercise: str, lab: Any,
              world: int | None, refuse_reference: bool, what: str, hint: str) -> dict[int, dict]:
    """One case on the lab's ranks (or ranks ``0..world-1``), judged here: verdicts by rank.

    The inputs are drawn here, from a seed no rank sees, and each rank is sent only its own,
    so no rank can know the answer without communicating.
    """
    import secrets

    shape, dtype, _ = case
    taking_part = world or lab.world_size
    seed = secrets.randbits(40)         # 1000 * seed + rank fits a generator seed
    sent = [_make(shape, dtype, seed, rank) for rank in range(taking_part)]
    left = run_student_code(what, _on_rank, fn, forbidden, exercise, world, refuse_reference, case,
                            lab=lab, timeout=DEADLOCK_TIMEOUT, hint=hint,
                            each={rank: (sent[rank],) for rank in range(taking_part)})
    verdicts = {}
    for rank in range(taking_part):
        verdict = _judge(case, sent, left[rank], taking_part)
        strays = left[rank].get("strays") if isinstance(left[rank], dict) else None
        if strays:
            verdict["count"] = verdict["count"] or 1
            verdict["note"] = (f"it called {strays[0]}, but on {world} ranks there is no rank "
                               f"{strays[0].split('=')[1].rstrip(')')}")
        elif (verdict["count"] and isinstance(left[rank], dict) and left[rank].get("returned_new")
              and _equal(left[rank]["got"], sent[rank])):
            verdict["note"] = ("it returned a new tensor and left its argument unchanged; sum into "
                               "the tensor it is given, in place, as dist.all_reduce does")
        verdicts[rank] = verdict
    return verdicts


def _equal(a, b) -> bool:
    import torch
    return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _report(exercise: str, by_rank: list[list[dict]], hint: str) -> None:
    """Raise a ``Feedback`` about the first case that is wrong on some rank."""
    world_size = len(by_rank)
    failing = [i for i in range(len(by_rank[0])) if any(v[i]["count"] for v in by_rank)]
    if not failing:
        return
    first = failing[0]
    shape, dtype, seed = by_rank[0][first]["case"]
    length = 1
    for size in shape:
        length *= size
    wrong = [rank for rank in range(world_size) if by_rank[rank][first]["count"]]
    rows, detail = [], []
    for rank in wrong:
        verdict = by_rank[rank][first]
        rows.append(Row(rank, f"{verdict['count']} of {length} elements wrong"
                    + (f" ({verdict['note']})" if verdict["note"] else ""), wrong=True))
        detail += [f"  rank {rank}, element {index}: expected {_number(expected)}, got {_number(got)}"
                   for index, expected, got in verdict["shown"]]
    if len(failing) > 1:
        detail.append(f"{len(failing) - 1} more of the {len(by_rank[0])} cases are wrong too.")
    raise Feedback(f"{exercise} is wrong on {ranks_phrase(wrong)} for shape={list(shape)}, "
                   f"dtype={dtype}, seed={seed} ({length} elements on {world_size} ranks"
                   f"{', not a multiple of world_size' if length % world_size else ''}); "
                   f"compared with dist.all_reduce.", rows=rows, detail=detail, hint=hint)


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def check_all_reduce(fn: Callable, exercise: str, forbidden: tuple[str, ...] = COLLECTIVES,
                     hint: str = "", lab: Any = None, case_list: list | None = None,
                     quiet: bool = False, refuse_reference: bool = True) -> None:
    """Run ``fn`` on every rank for every case; print one line, or raise naming what is wrong.

    ``refuse_reference=False`` is for testing ``ddplab.algorithms`` itself: an answer that
    runs those (or a copy) is otherwise refused. A graded check cell never passes it.
    """
    if not callable(fn):
        raise Feedback(f"{exercise} needs your function, but got {fn!r}.",
                       hint=f"pass it: ddplab.check.{exercise}(my_{exercise}).")
    lab = lab_or_current(lab)
    case_list = cases() if case_list is None else case_list
    by_rank = [[] for _ in range(lab.world_size)]
    for case in case_list:           # one call per case: a deadlock shows within DEADLOCK_TIMEOUT
        verdicts = _run_case(fn, case, forbidden, exercise, lab, None, refuse_reference,
                             f"{exercise}(tensor) on shape={list(case[0])}, dtype={case[1]}",
                             DEADLOCK_HINT)
        for rank, verdict in verdicts.items():
            by_rank[rank].append(verdict)
    _report(exercise, by_rank, hint or "run it on a small tensor and print what each rank "
            "sends and receives.")
    if quiet:
        return
    shapes = sorted({"x".join(map(str, shape)) for shape, _, _ in case_list}, key=lambda s: (len(s), s))
    dtypes = sorted({dtype for _, dtype, _ in case_list})
    passed(f"{exercise} matches dist.all_reduce on every rank for {len(case_list)} cases "
           f"(shapes {', '.join(shapes)}; {', '.join(dtypes)}).")


@checker
def naive_all_reduce_collectives(fn: Callable, lab: Any = None) -> None:
    """Check reduce-then-broadcast written with ``dist.reduce`` and ``dist.broadcast``."""
    check_all_reduce(fn, "naive_all_reduce_collectives", ("all_reduce",),
                     "a reduce leaves the sum on one rank only (its dst); a broadcast then copies "
                     "that rank's tensor into every rank's, in place.", lab)


@checker
def naive_all_reduce(fn: Callable, lab: Any = None) -> None:
    """Check reduce-then-broadcast written with send/recv only."""
    check_all_reduce(fn, "naive_all_reduce", COLLECTIVES,
                     "rank 0 receives every other rank's tensor and adds it, then sends the "
                     "sum back; the other ranks send theirs, then receive into their tensor.", lab)


def _follow_messages(fn: Callable, exercise: str, length: int, lab: Any) -> list[list]:
    """Every rank's sends and receives in one call of ``fn`` on ``length`` elements (``message_log``).

    A hang is reported like any case's, within ``DEADLOCK_TIMEOUT`` and with its hint.
    """
    return run_student_code(f"{exercise}(tensor) on shape=[{length}], dtype=float32, its messages "
                            f"followed", message_log, fn, exercise, length, COLLECTIVES, lab=lab,
                            timeout=DEADLOCK_TIMEOUT, hint=DEADLOCK_HINT)


RING_HINT = ("cut the tensor into p chunks (tensor_split: their lengths may differ). In the "
             "reduce-scatter, each of p - 1 steps passes one chunk to the right and adds the "
             "chunk from the left into your copy of it, a different chunk each step, until "
             "every rank holds one finished chunk; the all-gather passes the finished chunks "
             "around. Follow one chunk in the ring picture above.")
#: Elements per rank in the tensor whose messages the ring check follows: p chunks of this many.
_RING_CHUNK = 4


@checker
def ring_all_reduce(fn: Callable, lab: Any = None) -> None:
    """Check a ring all_reduce (reduce-scatter then all-gather) built from send/recv.

    Beyond matching ``dist.all_reduce``, its messages must be a ring's: on one
    tensor of ``4p`` elements, every rank sends only to its right neighbour
    (rank + 1) % p and receives only from its left one, 2(p-1) times each, and
    every message is one chunk of ``4`` elements (1/p of the tensor), never
    the whole tensor. So a naive reduce-then-broadcast, or any other plan that
    sums right, fails.
    """
    exercise = "ring_all_reduce"
    check_all_reduce(fn, exercise, COLLECTIVES, RING_HINT, lab, quiet=True)
    p = lab.world_size
    length = _RING_CHUNK * p
    logs = _follow_messages(fn, exercise, length, lab)
    problems = ring_problems(logs, length)
    if problems:
        raise Feedback(
            f"{exercise} sums correctly on {p} ranks, but its messages are not a ring's (one call "
            f"on {length} elements, followed on every rank).",
            detail=[*(f"  {line}" for line in problems[:6]),
                    *([f"  ... and {len(problems) - 6} more"] if len(problems) > 6 else []),
                    f"In a ring every rank sends only to its right neighbour (rank + 1) % p and "
                    f"receives only from its left one (rank - 1) % p: 2(p-1) = {2 * (p - 1)} "
                    f"messages each way, each one chunk of 1/p of the tensor ({_RING_CHUNK} of "
                    f"{length} elements here)."],
            hint=RING_HINT)
    passed(f"{exercise} matches dist.all_reduce on every rank for {len(cases())} cases, and each "
           f"rank sent {2 * (p - 1)} chunks of 1/{p} of the tensor to its right neighbour and "
           f"received {2 * (p - 1)} from its left one.")


@checker
def recursive_doubling_all_reduce(fn: Callable, lab: Any = None) -> None:
    """Check recursive doubling (pairwise exchange with rank XOR 2**k) built from send/recv.

    On a lab whose size is a power of two (4 ranks), it also runs the function
    on ranks 0..p-2 alone as a job of p - 1 ranks (3), so that an answer
    without the non-power-of-two steps fails.
    """
    exercise = "recursive_doubling_all_reduce"
    hint = ("in each round every rank exchanges its whole tensor with a partner whose rank differs "
            "from its own in one bit, and both add; wait for your isend before adding into the "
            "tensor you are sending.")
    n = lab.world_size
    odd = n - 1 if n >= 4 and n & (n - 1) == 0 else None     # a non-power-of-two size to try too
    if odd is None:
        check_all_reduce(fn, exercise, COLLECTIVES, hint, lab)
        return
    check_all_reduce(fn, exercise, COLLECTIVES, hint, lab, quiet=True)
    case_list = cases()
    got: dict[int, list[dict]] = {r: [] for r in range(odd)}
    for case in case_list:           # one call per case: a deadlock shows within DEADLOCK_TIMEOUT
        verdicts = _run_case(
            fn, case, COLLECTIVES, exercise, lab, odd, True,
            f"{exercise} on {odd} ranks (0..{odd - 1} of this lab), shape={list(case[0])}, "
            f"dtype={case[1]}",
            f"on {odd} ranks, a rank beyond the largest power of two waits for a partner of "
            f"its own below it, before the rounds and after them; a rank whose partner does not "
            f"exist must not wait for it.")
        for rank in range(odd):
            got[rank].append(verdicts[rank])
    _report(f"{exercise} on {odd} ranks", [got[r] for r in range(odd)],
            f"{odd} is not a power of two: the ranks beyond the largest power of two q <= p hand "
            f"their tensor to a rank below q before the rounds, and get the sum back after them.")
    passed(f"{exercise} matches dist.all_reduce on every rank for {len(case_list)} cases on "
           f"{n} ranks, and on {odd} of them (not a power of two).")


@checker
def tree_all_reduce(fn: Callable, lab: Any = None) -> None:
    """Check a tree all_reduce: whole tensors reduced up a tree to rank 0, then broadcast down it.

    Beyond matching ``dist.all_reduce``, the messages must draw a tree: each
    rank but 0 sends its partial sum up once and receives the result once
    (2(p-1) messages in all); its first send names its parent; rank 0 takes
    at most ceil(log2 p) messages (not a star), and the tree is at most
    ceil(log2 p) levels deep (not a chain).
    """
    exercise = "tree_all_reduce"
    hint = ("reduce up a binomial tree: each round, half of the ranks still holding a partial sum "
            "send it to a partner and stop, the partner adds; then the same tree backwards, each "
            "rank receiving from its parent and sending to its children.")
    check_all_reduce(fn, exercise, COLLECTIVES, hint, lab, quiet=True)
    logs = _follow_messages(fn, exercise, 6, lab)
    p = lab.world_size
    levels = (p - 1).bit_length()                       # ceil(log2 p)
    sends = sum(op == "send" for log in logs for op, _, _ in log)
    parents = {rank: next((peer for op, peer, _ in log if op == "send"), None)
               for rank, log in enumerate(logs) if rank}
    into_root = sum(op == "recv" for op, _, _ in logs[0])
    depth = tree_depth(parents)
    problems = []
    if sends == 0 or None in parents.values():
        # Its sums are right, so every rank's data left it: a rank with no send
        # seen sent through a name bound before the check could watch it.
        raise Feedback(f"{exercise} sums correctly, but none of its messages could be seen.",
                       hint="call dist.send / dist.recv (or isend / irecv) through `dist.` (import "
                            "torch.distributed as dist), so the check can follow them.")
    if sends != 2 * (p - 1):
        problems.append(f"{sends} messages were sent in all; a tree sends 2(p-1) = {2 * (p - 1)}: "
                        f"every rank but 0 sends its partial sum up once, and receives the sum once")
    if into_root > levels:
        problems.append(f"rank 0 received {into_root} messages, one from every rank (a star, as "
                        f"the naive version); in a tree it receives at most ceil(log2 p) = {levels}")
    if depth is None:
        problems.append("the first sends do not lead every rank to rank 0: "
                        + ", ".join(f"{r} -> {parents[r]}" for r in sorted(parents)))
    elif depth > levels:
        problems.append(f"the tree is {depth} levels deep (a chain); a binomial tree needs only "
                        f"ceil(log2 p) = {levels}")
    if problems:
        raise Feedback(f"{exercise} sums correctly on {p} ranks, but its messages do not form a tree.",
                       detail=[f"  {line}" for line in problems], hint=hint)
    edges = ", ".join(f"{r} -> {parents[r]}" for r in sorted(parents))
    passed(f"{exercise} matches dist.all_reduce on every rank for {len(cases())} cases, with "
           f"{2 * (p - 1)} messages on {p} ranks up and down a tree {depth} levels deep "
           f"(each rank -> its parent: {edges}).")
