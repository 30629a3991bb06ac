"""Checkers for notebook 01, point-to-point communication (send/recv, isend/irecv, batches).

    ddplab.check.ping_pong(ping_pong)       # the student's function, on inputs drawn here
    ddplab.check.ring_token()               # the `token` a %%ranks cell left on every rank
    ddplab.check.who_waited((1, "recv"))    # read off the timeline (``_timeline``)

Most exercises here are functions the student writes in the notebook, such as
``def swap(t): ...``. The check cell passes the function in:

    ddplab.check.swap_tensors(swap)

and the checker calls it on every rank, several times, with fresh inputs of
a few shapes and dtypes, so an answer that only fits the notebook's numbers
fails. The checker makes every rank's input itself, from a seed drawn for
each trial that no rank sees, and sends each rank only its own
(``Lab.run_each``): a rank learns another's input only by communicating. The
answers come back and are compared here, with the checker's torch, against
what it knows the inputs were; nothing on a rank holds the expected answer.
``ring_token`` instead reads the ``token`` a ``%%ranks`` cell left on each rank.

A student's function that raises fails the check with the student's exception
and their own traceback. One that deadlocks fails it with where each rank is
stuck, after ``timeout`` seconds; the lab then needs ``lab.restart()``. The
tables show expected values where they are made from inputs the check drew;
``ring_token`` checks a value the student's cell leaves on the ranks, so its
table says what the token should be, never the number.
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import checker, compare, passed, run_student_code, values_on_ranks
from ._feedback import Feedback
from ._forbid import COLLECTIVES, forbidding
from ._peers import swap_peer_calls
from ._timeline import traced

__all__ = ["all_gather_p2p", "neighbour_exchange", "ping_pong", "ring_token", "swap_tensors",
           "who_waited"]

# (shape, dtype) of the inputs each function-checker tries: a scalar-like
# vector, a longer one, a matrix, and integers (so a stray float() shows up).
_CASES = [((1,), "float32"), ((5,), "float32"), ((2, 3), "float64"), ((4,), "int64")]
_CHECK_TIMEOUT = 15.0            # a trial takes well under a second: longer is a deadlock
# Said where the lab sees no pattern of its own (all in send, all in recv): nothing about where.
_DEADLOCK_HINT = ("a send waits for the matching recv on the rank it names, and a recv for a send: "
                  "check that every message has both ends (dst= and src= naming each other), "
                  "posted in an order that lets one of them start.")


def sample(case: int, rank: int, seed: int = 0) -> Any:
    """The input rank ``rank`` gets in trial ``case`` with ``seed``: distinct per rank and per trial.

    Made by the checker, which draws ``seed`` for each trial (``_trials``) and
    sends each rank its own input.
    """
    import torch

    shape, dtype = _CASES[case]
    generator = torch.Generator().manual_seed((seed << 16) + 1000 * case + rank)
    values = torch.randint(-50, 50, shape, generator=generator) + 100 * (rank + 1)
    return values.to(getattr(torch, dtype))


def _matching(case: int):
    """A context manager: a send or receive of a tensor unlike this trial's inputs fails, named.

    Every tensor on the wire in a trial has the input's dtype and size. gloo
    does not check: a receive into a buffer of another dtype (``torch.zeros(3)``
    for an int64 input) has another byte count, and the rank aborts with a
    message about "a collective". So each send and receive checks first.
    """
    import contextlib

    shape, dtype = _CASES[case]
    numel = 1
    for size in shape:
        numel *= size

    def matching(name, keyword, real):
        def call(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            kind = (str(getattr(tensor, "dtype", "?")).replace("torch.", ""),
                    tensor.numel() if hasattr(tensor, "numel") else "?")
            if kind != (dtype, numel):
                role = "sends" if "send" in name else "receives into"
                raise Feedback(
                    f"a dtype or size mismatch: dist.{name} {role} a tensor of {kind[0]}, "
                    f"{kind[1]} element(s), but in this trial every rank's input is {dtype}, "
                    f"{numel} element(s) (shape {list(shape)}).",
                    hint="point-to-point calls copy raw bytes: the receive buffer must have the "
                         "sender's dtype and size, or the receiving rank crashes. Make buffers "
                         "with torch.empty_like(t) and send t itself (no .float(), no new "
                         "torch.zeros(...)); then lab.restart(), since a message already sent may "
                         "be left unreceived, and check again.")
            return real(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def guard():
        undo = swap_peer_calls(matching)
        try:
            yield
        finally:
            undo()
    return guard()


def _what(name: str, case: int) -> str:
    shape, dtype = _CASES[case]
    return f"{name} with an input of shape {list(shape)} and dtype {dtype}"


def _needs_function(fn: Any, checker: str, example: str) -> None:
    if not callable(fn):
        raise Feedback(f"ddplab.check.{checker} needs the function you wrote, but got {fn!r}.",
                       hint=f"pass the function itself: ddplab.check.{checker}({example}).")


def _needs_world_size(lab: Any, checker: str, allowed: Callable[[int], bool], wanted: str) -> None:
    if not allowed(lab.world_size):
        raise Feedback(f"ddplab.check.{checker} checks a lab of {wanted}, but the running lab "
                       f"has world_size={lab.world_size}.",
                       hint="start the right one with lab = ddplab.start(world_size=...) and run "
                            "your cells again.")


def _trials(trial: Callable, fn: Callable, lab: Any, timeout: float) -> list[tuple[list, list]]:
    """For each case: (every rank's input, what ``trial(fn, case, input)`` returned on each rank).

    The inputs are made here from a seed drawn for the trial, and each rank is
    sent only its own. A deadlock or an exception in the student's code
    becomes a ``Feedback`` (``run_student_code``), a deadlock after
    ``timeout`` seconds, with a hint.
    """
    import secrets

    n = lab.world_size
    trials = []
    for case in range(len(_CASES)):
        seed = secrets.randbits(40)
        inputs = [sample(case, rank, seed) for rank in range(n)]
        got = run_student_code(_what(getattr(fn, "__name__", "your function"), case), trial, fn, case,
                               lab=lab, timeout=timeout, hint=_DEADLOCK_HINT,
                               each={rank: (inputs[rank],) for rank in range(n)})
        trials.append((inputs, [got[rank] for rank in range(n)]))
    return trials


# ------------------------------------------------------------------ ping_pong
def _ping_pong_trial(fn: Callable, case: int, x: Any) -> Any:
    with _matching(case):
        return fn(x)


@checker
def ping_pong(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(x)`` on 2 ranks: rank 0 sends ``x``, rank 1 sends back twice what it got.

    Rank 0 must return the reply (``2 * x`` of rank 0), rank 1 what it
    received (rank 0's ``x``), both with ``x``'s shape and dtype.
    """
    _needs_function(fn, "ping_pong", "ping_pong")
    _needs_world_size(lab, "ping_pong", lambda n: n == 2, "2 ranks")
    for case, (inputs, got) in enumerate(_trials(_ping_pong_trial, fn, lab, timeout)):
        x0 = inputs[0]
        compare(_what("ping_pong(x)", case), [2 * x0, x0], got,
                hint="rank 0 returns the reply that comes back from rank 1, rank 1 what it "
                     "received from rank 0; the reply is twice what rank 1 received. Receive into "
                     "a buffer of x's shape and dtype.")
    passed("rank 0 got back twice what it sent, and rank 1 got exactly what rank 0 sent.")


# --------------------------------------------------------------- swap_tensors
def _keep_input_trial(fn: Callable, case: int, t: Any) -> list[Any]:
    """Call ``fn`` on this rank's input; return its answer and the input as it is afterwards."""
    with _matching(case):
        answer = fn(t)
    return [answer, t]


@checker
def swap_tensors(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(t)`` on 2 ranks: each returns the other rank's ``t`` and leaves its own unchanged."""
    _needs_function(fn, "swap_tensors", "swap")
    _needs_world_size(lab, "swap_tensors", lambda n: n == 2, "2 ranks")
    for case, (inputs, got) in enumerate(_trials(_keep_input_trial, fn, lab, timeout)):
        compare(_what("swap(t)", case), [inputs[1], inputs[0]], [answer for answer, _ in got],
                hint="each rank returns a new tensor that receives the other rank's t while it "
                     "sends its own; both must have completed before it returns.")
        compare(_what("t after swap(t)", case), inputs, [t for _, t in got],
                hint="receive into a new buffer (torch.empty_like(t)), not into t: isend may "
                     "still be reading t, and the caller's t must stay as it was.")
    passed("each rank returned the other rank's tensor and kept its own.")


# --------------------------------------------------------- neighbour_exchange
def _exchange_trial(fn: Callable, case: int, t: Any) -> list[Any]:
    """The student's ``(from_left, from_right)``, and the input afterwards."""
    with _matching(case):
        answer = fn(t)
    return [answer, t]


@checker
def neighbour_exchange(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(t)``: each rank returns ``(from_left, from_right)``, its neighbours' ``t``.

    The left neighbour of rank ``r`` is ``(r - 1) % world_size``, the right one
    ``(r + 1) % world_size``. The reference is ``dist.all_gather`` of every
    rank's ``t`` (the inputs the checker sent); ``t`` itself must be left unchanged.
    """
    _needs_function(fn, "neighbour_exchange", "exchange")
    _needs_world_size(lab, "neighbour_exchange", lambda n: n >= 3, "3 or more ranks")
    n = lab.world_size
    for case, (everyone, got) in enumerate(_trials(_exchange_trial, fn, lab, timeout)):
        expected, answers = [], []
        for rank, (answer, _) in enumerate(got):
            expected.append((everyone[(rank - 1) % n], everyone[(rank + 1) % n]))
            answers.append(tuple(answer) if isinstance(answer, list) else answer)
        compare(_what("exchange(t) -> (from_left, from_right)", case), expected, answers,
                hint="a rank receives both neighbours' t into new buffers of its own while it "
                     "sends its t to both: four operations in one batch, every request waited on.")
        compare(_what("t after exchange(t)", case), everyone, [t for _, t in got],
                hint="receive into new buffers, not into t.")
    passed("every rank got its left and right neighbours' tensors, in that order.")


# -------------------------------------------------------------- all_gather_p2p
def _all_gather_trial(fn: Callable, case: int, t: Any) -> list[Any]:
    """The student's output list, and the input afterwards."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    # Filled with -1, so an entry the student never writes shows as -1, not as a lucky 0.
    got = [torch.full_like(t, -1) for _ in range(n)]
    with forbidding(COLLECTIVES, "my_all_gather", builds="all_gather"), _matching(case):
        fn(got, t)
    return [got, t]


@checker
def all_gather_p2p(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(tensor_list, tensor)`` against ``dist.all_gather(tensor_list, tensor)``.

    Like ``dist.all_gather``, ``fn`` fills the given output list in place:
    entry ``i`` becomes rank ``i``'s ``tensor``, on every rank; ``tensor`` is unchanged.
    The exercise builds all_gather from send/recv, so during ``fn`` the collectives
    (``dist.all_gather`` first) raise, naming the one called.
    """
    _needs_function(fn, "all_gather_p2p", "my_all_gather")
    _needs_world_size(lab, "all_gather_p2p", lambda n: n >= 2, "2 or more ranks")
    for case, (inputs, got) in enumerate(_trials(_all_gather_trial, fn, lab, timeout)):
        compare(_what("tensor_list after my_all_gather(tensor_list, tensor)", case),
                [inputs] * lab.world_size, [answer for answer, _ in got],
                hint="tensor_list[i] must end up equal to rank i's tensor, on every rank "
                     "(your own entry too: copy_ it). Fill the list's tensors in place "
                     "(irecv into tensor_list[i]); rebinding the name does not change the "
                     "caller's list.")
        compare(_what("tensor after my_all_gather(tensor_list, tensor)", case),
                inputs, [t for _, t in got],
                hint="tensor is the input; only tensor_list is written.")
    passed("my_all_gather fills tensor_list exactly like dist.all_gather.")


# ------------------------------------------------------------------ ring_token
@checker
def ring_token(lab: Any = None) -> None:
    """Check the ``token`` every rank holds after the token has gone once around the ring.

    Rank 0 starts with ``torch.tensor([0.0])`` and sends it right. Every other
    rank ``r`` receives it from the left, adds ``r``, keeps it as ``token`` and
    sends it right; rank 0's ``token`` is what comes back from the last rank.
    """
    import torch

    _needs_world_size(lab, "ring_token", lambda n: n >= 2, "2 or more ranks")
    got = values_on_ranks("token", lab)
    # The same ring, walked in one process.
    expected, running = [None] * lab.world_size, 0.0
    for rank in range(1, lab.world_size):
        running += rank
        expected[rank] = torch.tensor([running])
    expected[0] = torch.tensor([running])
    compare("token", expected, got,
            show_expected="the ring's sum up to this rank (rank 0: what came back around)",
            hint="each rank but 0 waits for the token from its left neighbour, adds its own rank "
                 "and passes it on to the right; rank 0 starts it and keeps what comes back.")
    passed(f"the token went once around the ring of {lab.world_size} ranks.")


# ------------------------------------------------------------------ who_waited
@checker(reads_trace=True)
def who_waited(answer: Any, trace: Any = None) -> None:
    """Which call waited longest, on which rank? ``answer``: ``(rank, op)``, e.g. ``(1, "recv")``."""
    __tracebackhide__ = True
    trace = traced(trace, "who_waited")
    waits = [e for e in trace.events if e.waited > 0]
    if not waits:
        raise Feedback("in this trace no call waited for another rank.",
                       hint="re-run the traced cell above.")
    longest = max(waits, key=lambda e: e.waited)
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise Feedback(f"answer with (rank, op), e.g. ddplab.check.who_waited((1, 'recv')); "
                       f"got {answer!r}.")
    rank, op = answer
    if (rank, op) != (longest.rank, longest.op):
        raise Feedback(f"({rank!r}, {op!r}) is not the call that waited longest: "
                       f"{_why_not(trace, rank, op)}",
                       hint="waiting is the hatched part of a box; find the longest hatching, then "
                            "its rank (the lane) and its op (the label; a wait() is \"wait\").")
    passed(f"{longest.op} on rank {longest.rank} waited longest, for the other rank.")


def _why_not(trace: Any, rank: Any, op: Any) -> str:
    """Why ``(rank, op)`` is wrong, without giving away the right call or its time."""
    if rank not in trace.ranks:
        return f"the trace has ranks {', '.join(map(str, trace.ranks))}, and no rank {rank!r}."
    ops = sorted({e.op for e in trace.on(rank)})
    if op not in ops:
        return (f"rank {rank} made no {op!r} call in this trace; it made "
                f"{', '.join(repr(o) for o in ops) or 'none'}.")
    if not any(e.waited > 0 for e in trace.on(rank) if e.op == op):
        return f"{op} on rank {rank} did not wait for the other rank at all in this trace."
    return f"{op} on rank {rank} waited, but another call waited longer."
