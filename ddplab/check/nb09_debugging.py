"""Checkers of notebook 09 (debugging distributed training): diagnosis, graded on what was found.

Each exercise hands the learner a program with a bug they do not know
(``mystery(kind)``, the course's programs in ``ddplab.course.mysteries``), the tool to find it with,
and asks for a function that reads the tool's output and says what is wrong:
which rank, which collective, which op, which line. The checker then runs a
*variant* of the program the learner never saw (another seed: another rank,
another step, another line) and calls the learner's function, on a rank, with
that variant's tool output. A number copied from the page, or a function that
returns it, fails; a function that reads the tool the way the lesson shows passes.
A wrong diagnosis says which part was wrong (the rank, the line), and the hint
how to read the tool; never the variant's answer.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from ..course import mysteries
from ..course.mysteries import Mystery, mystery
from ._core import answers_of, checker, passed, student_raised
from ._feedback import Feedback

__all__ = ["Mystery", "detail_mismatch", "flight_dump", "mystery", "stuck_stack",
           "torchrun_logs", "unused_parameters"]

def variant(kind: str, differs: Callable[[dict, dict], bool]) -> Mystery:
    """A variant the learner never saw, whose truth differs from seed 0's where ``differs`` says."""
    shown = mysteries.make(kind, 0).truth
    rng = random.SystemRandom()
    while True:
        seed = rng.randrange(1, 10_000)
        if differs(shown, mysteries.make(kind, seed).truth):
            from ddplab.lab.scratch import scratch_folder
            return Mystery(kind, seed, scratch_folder("variant"))


def _all_differ(*keys: str) -> Callable[[dict, dict], bool]:
    return lambda a, b: all(a[key] != b[key] for key in keys)


def _needs_function(fn: Any, name: str) -> None:
    if not callable(fn):
        raise Feedback(f"ddplab.check.{name} needs your function; got {type(fn).__name__} {fn!r}.",
                       hint=f"pass it: ddplab.check.{name}(your_function).")


def _ask(fn: Callable, name: str, *args: Any) -> Any:
    """The learner's ``fn(*args)``, computed on rank 0; a raise fails the check, named."""
    answer = answers_of(fn, [args])[0]
    if answer[0] != "ok":
        raise student_raised(f"your {name} on the output of a variant of the program (another "
                             f"seed: another rank, step or line)", answer,
                             hint="read the tool's output as it comes, not the example's numbers.")
    return answer[1]


def _field(answer: Any, key: str, name: str) -> Any:
    if not isinstance(answer, dict) or key not in answer:
        raise Feedback(f"your {name} must return a dict with the key {key!r} (as the exercise "
                       f"shows); it returned {answer!r}.")
    return answer[key]


def _op(name: Any) -> str:
    """``all_reduce``, ``ALLREDUCE``, ``gloo:all_reduce`` all name one op."""
    return str(name).split(":")[-1].replace("_", "").upper()


def _wrong(what: str, why: str) -> Feedback:
    return Feedback(f"on a variant of the program (another seed), your diagnosis got {what} wrong.",
                    hint=why)


# ----------------------------------------------------------------- the flight recorder
@checker
def flight_dump(fn: Callable, lab: Any = None) -> None:
    """``fn(dumps)`` -> ``{"rank", "collective", "op"}`` on a variant's flight recorder dumps."""
    __tracebackhide__ = True
    _needs_function(fn, "flight_dump")
    bug = variant("flight", _all_differ("rank", "collective"))
    dumps = bug.run(lab)
    got, truth = _ask(fn, "diagnose_flight(dumps)", dumps), bug.program.truth
    if _field(got, "rank", "diagnose_flight") != truth["rank"]:
        raise _wrong("the rank", "the rank to name is the one that never reached the collective "
                     "the other waits in: its last collective_seq_id is the lower one.")
    if _field(got, "collective", "diagnose_flight") != truth["collective"]:
        raise _wrong("the collective", "it is the highest collective_seq_id, the one only the "
                     "waiting rank issued (counted on the program's group).")
    if _op(_field(got, "op", "diagnose_flight")) != _op(truth["op"]):
        raise _wrong("the op", "take profiling_name of the waiting rank's last entry "
                     "(gloo:<op>).")
    passed("your reading of the flight recorder found the rank, the collective and the op of a "
           "variant you had not seen.")


# ------------------------------------------------------------ TORCH_DISTRIBUTED_DEBUG=DETAIL
@checker
def detail_mismatch(fn: Callable, lab: Any = None) -> None:
    """``fn(message)`` -> ``{"collective", "ops"}`` on a variant's DETAIL mismatch message."""
    __tracebackhide__ = True
    _needs_function(fn, "detail_mismatch")
    bug = variant("detail", lambda a, b: a["collective"] != b["collective"]
                  and a["ops"] != b["ops"])
    messages = bug.run(lab)
    truth = bug.program.truth
    got = _ask(fn, "diagnose_detail(message)", messages[1])     # rank 1's: the order differs
    if _field(got, "collective", "diagnose_detail") != truth["collective"]:
        raise _wrong("the collective", "DETAIL's SequenceNumber counts from 0, the program's "
                     "collectives from 1.")
    ops = _field(got, "ops", "diagnose_detail")
    if not isinstance(ops, dict) or {r: _op(o) for r, o in ops.items()} != truth["ops"]:
        raise _wrong("the ops", "give each rank's OpType as a dict {rank: op}; the message "
                     "names 'Rank A is running collective: ... but Rank B is running ...', in "
                     "either order.")
    passed("your reading of DETAIL's message found the collective and each rank's op of a "
           "variant you had not seen.")


# ------------------------------------------------------------ INFO: the unused parameter
@checker
def unused_parameters(fn: Callable, lab: Any = None) -> None:
    """``fn(message)`` -> the names of the parameters without a gradient, on a variant's error."""
    __tracebackhide__ = True
    _needs_function(fn, "unused_parameters")
    bug = variant("unused", _all_differ("parameters"))
    message = bug.run(lab)[0]
    got = _ask(fn, "unused_names(message)", message)
    if not isinstance(got, (set, list, tuple)) or {str(n).strip() for n in got} \
            != bug.program.truth["parameters"]:
        raise _wrong("the parameters", "return the names after 'Parameters which did not "
                     "receive grad for rank N:' as a set, e.g. {'aux.weight', 'aux.bias'}.")
    passed("your reading of DDP's INFO message named the unused parameters of a model you had "
           "not seen.")


# --------------------------------------------------------------- faulthandler's stacks
@checker
def stuck_stack(fn: Callable, lab: Any = None) -> None:
    """``fn(stacks, path)`` -> ``{"rank", "function", "line"}`` on a variant's thread dumps."""
    __tracebackhide__ = True
    _needs_function(fn, "stuck_stack")
    bug = variant("stacks", _all_differ("rank", "line"))
    stacks = bug.run(lab)
    got, truth = _ask(fn, "diagnose_stacks(stacks, path)", stacks, bug.path), bug.program.truth
    if _field(got, "rank", "diagnose_stacks") != truth["rank"]:
        raise _wrong("the rank", "the rank to name is the one stuck outside torch.distributed: "
                     "the other one waits in a collective for it.")
    if _field(got, "function", "diagnose_stacks") != truth["function"] or \
            _field(got, "line", "diagnose_stacks") != truth["line"]:
        raise _wrong("the function or line", "take the innermost frame (the first listed: most "
                     "recent call first) in the program's file, in the thread that runs it.")
    passed("your reading of faulthandler's stacks found the stuck rank, function and line of a "
           "variant you had not seen.")


# ------------------------------------------------------------------- torchrun's output
@checker(needs_lab=False)
def torchrun_logs(fn: Callable, lab: Any = None) -> None:
    """``fn(output)`` -> ``{"rank", "error", "line"}`` on a variant's torchrun ``--tee 3`` output."""
    __tracebackhide__ = True
    _needs_function(fn, "torchrun_logs")
    bug = variant("torchrun", _all_differ("rank", "line"))
    output = bug.run(lab)
    got, truth = _ask(fn, "diagnose_torchrun(output, path)", output, bug.path), bug.program.truth
    if _field(got, "rank", "diagnose_torchrun") != truth["rank"]:
        raise _wrong("the rank", "the rank to name raised first; the other one only lost its "
                     "partner (a collective's error, or torchrun ended it).")
    if str(_field(got, "error", "diagnose_torchrun")) != truth["error"]:
        raise _wrong("the error", "name the exception class on that rank's last [defaultN]: line.")
    if _field(got, "line", "diagnose_torchrun") != truth["line"]:
        raise _wrong("the line", "take the last frame in the script's file of that rank's "
                     "traceback.")
    passed("your reading of torchrun's output found the rank, the error and the line of a variant "
           "you had not seen.")
