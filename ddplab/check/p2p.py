"""Checkers for notebook 01, point-to-point communication (send/recv, isend/irecv, batches).

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

A student's function that raises fails the check with ``RankError`` (that
rank's traceback). One that deadlocks fails it with an ``AssertionError``
saying where each rank is stuck, after ``timeout`` seconds; the lab then
needs ``lab.restart()``.
"""

from __future__ import annotations

from typing import Any, Callable

from ._core import (
    compare,
    lab_or_current,
    passed,
    run_student_code,
    swap_peer_calls,
    values_on_ranks,
)
from ._forbid import COLLECTIVES, forbidding

__all__ = ["all_gather_p2p", "neighbour_exchange", "ping_pong", "ring_token", "swap_tensors"]

# (shape, dtype) of the inputs each function-checker tries: a scalar-like
# vector, a longer one, a matrix, and integers (so a stray float() shows up).
_CASES = [((1,), "float32"), ((5,), "float32"), ((2, 3), "float64"), ((4,), "int64")]
_CHECK_TIMEOUT = 15.0            # a trial takes well under a second: longer is a deadlock
_DEADLOCK_HINT = ("two blocking sends facing each other wait forever; post the receives before "
                  "waiting (isend/irecv or batch_isend_irecv).")


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
                raise AssertionError(
                    f"a dtype or size mismatch: dist.{name} {role} a tensor of {kind[0]}, "
                    f"{kind[1]} element(s), but in this trial every rank's input is {dtype}, "
                    f"{numel} element(s) (shape {list(shape)}). Point-to-point calls copy raw "
                    f"bytes: the receive buffer must have the sender's dtype and size, or the "
                    f"receiving rank crashes. Make buffers with torch.empty_like(t) and send t "
                    f"itself (no .float(), no new torch.zeros(...)); then lab.restart(), since a "
                    f"message already sent may be left unreceived, and check again.")
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
        raise AssertionError(f"ddplab.check.{checker} needs the function you wrote, but got "
                             f"{fn!r}. Pass the function itself: ddplab.check.{checker}({example}).")


def _needs_world_size(lab: Any, checker: str, allowed: Callable[[int], bool], wanted: str) -> None:
    if not allowed(lab.world_size):
        raise AssertionError(f"ddplab.check.{checker} checks a lab of {wanted}, but the running lab "
                             f"has world_size={lab.world_size}. Start the right one with "
                             f"lab = ddplab.start(world_size=...) and run your cells again.")


def _trials(trial: Callable, fn: Callable, lab: Any, timeout: float) -> list[tuple[list, list]]:
    """For each case: (every rank's input, what ``trial(fn, case, input)`` returned on each rank).

    The inputs are made here from a seed drawn for the trial, and each rank is
    sent only its own. A deadlock or an exception in the student's code
    becomes an AssertionError (``run_student_code``), a deadlock after
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


def ping_pong(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(x)`` on 2 ranks: rank 0 sends ``x``, rank 1 sends back twice what it got.

    Rank 0 must return the reply (``2 * x`` of rank 0), rank 1 what it
    received (rank 0's ``x``), both with ``x``'s shape and dtype.
    """
    _needs_function(fn, "ping_pong", "ping_pong")
    lab = lab_or_current(lab)
    _needs_world_size(lab, "ping_pong", lambda n: n == 2, "2 ranks")
    for case, (inputs, got) in enumerate(_trials(_ping_pong_trial, fn, lab, timeout)):
        x0 = inputs[0]
        compare(_what("ping_pong(x)", case), [2 * x0, x0], got,
                hint="rank 1 receives into a buffer shaped like x (torch.empty_like(x)) with "
                     "recv(buffer, src=0), then sends 2 * buffer back with send(..., dst=0); "
                     "rank 0 returns what it receives, rank 1 what it received.")
    passed("rank 0 got back twice what it sent, and rank 1 got exactly what rank 0 sent.")


# --------------------------------------------------------------- swap_tensors
def _keep_input_trial(fn: Callable, case: int, t: Any) -> list[Any]:
    """Call ``fn`` on this rank's input; return its answer and the input as it is afterwards."""
    with _matching(case):
        answer = fn(t)
    return [answer, t]


def swap_tensors(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(t)`` on 2 ranks: each returns the other rank's ``t`` and leaves its own unchanged."""
    _needs_function(fn, "swap_tensors", "swap")
    lab = lab_or_current(lab)
    _needs_world_size(lab, "swap_tensors", lambda n: n == 2, "2 ranks")
    for case, (inputs, got) in enumerate(_trials(_keep_input_trial, fn, lab, timeout)):
        compare(_what("swap(t)", case), [inputs[1], inputs[0]], [answer for answer, _ in got],
                hint="each rank returns a new tensor filled by irecv(buffer, src=other rank), "
                     "while isend(t, dst=other rank) sends its own; wait() on both before returning.")
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


def neighbour_exchange(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(t)``: each rank returns ``(from_left, from_right)``, its neighbours' ``t``.

    The left neighbour of rank ``r`` is ``(r - 1) % world_size``, the right one
    ``(r + 1) % world_size``. The reference is ``dist.all_gather`` of every
    rank's ``t`` (the inputs the checker sent); ``t`` itself must be left unchanged.
    """
    _needs_function(fn, "neighbour_exchange", "exchange")
    lab = lab_or_current(lab)
    _needs_world_size(lab, "neighbour_exchange", lambda n: n >= 3, "3 or more ranks")
    n = lab.world_size
    for case, (everyone, got) in enumerate(_trials(_exchange_trial, fn, lab, timeout)):
        expected, answers = [], []
        for rank, (answer, _) in enumerate(got):
            expected.append((everyone[(rank - 1) % n], everyone[(rank + 1) % n]))
            answers.append(tuple(answer) if isinstance(answer, list) else answer)
        compare(_what("exchange(t) -> (from_left, from_right)", case), expected, answers,
                hint="irecv the left neighbour's t into one new buffer and the right one's into "
                     "another; isend t to both; put all four P2POps in one batch_isend_irecv "
                     "and wait() on every request it returns.")
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


def all_gather_p2p(fn: Callable, lab: Any = None, timeout: float = _CHECK_TIMEOUT) -> None:
    """Check ``fn(tensor_list, tensor)`` against ``dist.all_gather(tensor_list, tensor)``.

    Like ``dist.all_gather``, ``fn`` fills the given output list in place:
    entry ``i`` becomes rank ``i``'s ``tensor``, on every rank; ``tensor`` is unchanged.
    The exercise builds all_gather from send/recv, so during ``fn`` the collectives
    (``dist.all_gather`` first) raise, naming the one called.
    """
    _needs_function(fn, "all_gather_p2p", "my_all_gather")
    lab = lab_or_current(lab)
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
def ring_token(lab: Any = None) -> None:
    """Check the ``token`` every rank holds after the token has gone once around the ring.

    Rank 0 starts with ``torch.tensor([0.0])`` and sends it right. Every other
    rank ``r`` receives it from the left, adds ``r``, keeps it as ``token`` and
    sends it right; rank 0's ``token`` is what comes back from the last rank.
    """
    import torch

    lab = lab_or_current(lab)
    _needs_world_size(lab, "ring_token", lambda n: n >= 2, "2 or more ranks")
    got = values_on_ranks("token", lab)
    # The same ring, walked in one process.
    expected, running = [None] * lab.world_size, 0.0
    for rank in range(1, lab.world_size):
        running += rank
        expected[rank] = torch.tensor([running])
    expected[0] = torch.tensor([running])
    compare("token", expected, got,
            hint="rank r > 0 receives from (r - 1) % world_size into a float tensor of one "
                 "element, adds r, and sends to (r + 1) % world_size; rank 0 sends first, "
                 "then receives from the last rank.")
    passed(f"the token went once around the ring of {lab.world_size} ranks.")
