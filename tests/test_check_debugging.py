"""Checkers of notebook 09 (diagnosis): each grades what a learner's function *found*.

Every checker runs a variant of its mystery program the learner never saw, on a
real 2-rank gloo lab (``torchrun`` for one), and calls the learner's function on
that variant's tool output. Here each one passes the notebook's reference,
fails the stub, fails a plausible wrong reading with a message naming the
mistake, and fails the bypass: a function that returns the answer of the
variant the notebook shows (seed 0).
"""

from __future__ import annotations

import pytest
from conftest import fails, last_line

from ddplab.check import nb09_debugging as debugging
from ddplab.course import mysteries

pytestmark = pytest.mark.slow

#: The notebook's reference readings, defined as a notebook cell would define them
#: (module ``__main__``: they travel to the rank by value, as a learner's do).
REFERENCE = r'''
import re

def diagnose_flight(dumps):
    last = {rank: [e for e in dump["entries"] if not e["is_p2p"]][-1]
            for rank, dump in enumerate(dumps)}
    waiting = max(last, key=lambda rank: last[rank]["collective_seq_id"])
    behind = min(last, key=lambda rank: last[rank]["collective_seq_id"])
    entry = last[waiting]
    return {"rank": behind, "collective": entry["collective_seq_id"],
            "op": entry["profiling_name"].split(":")[-1]}

def diagnose_detail(message):
    found = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                       r"SequenceNumber=(\d+), OpType=(\w+)", message)
    return {"collective": int(found[0][1]) + 1, "ops": {int(r): op for r, _, op in found}}

def unused_names(message):
    line = next(line for line in message.splitlines()
                if "Parameters which did not receive grad" in line)
    return {name.strip() for name in line.split(":", 1)[1].split(",")}

def diagnose_stacks(stacks, path):
    for rank, text in enumerate(stacks):
        for thread in text.split("\n\n"):
            frames = re.findall(r'File "(.*)", line (\d+) in (\S+)', thread)
            mine = [i for i, (file, _, _) in enumerate(frames) if file == path]
            if not mine:
                continue
            first = mine[0]
            if not (first > 0 and "torch/distributed" in frames[first - 1][0]):
                return {"rank": rank, "function": frames[first][2], "line": int(frames[first][1])}

def diagnose_torchrun(output, path):
    lines = [line for line in output.splitlines() if line.startswith("[default")]
    for line in lines:
        found = re.match(r"\[default(\d+)\]:(?:\[rank\d+\]: )?(\w+(?:Error|Exception))\b", line)
        if found and found.group(2) != "RuntimeError":
            rank, error = int(found.group(1)), found.group(2)
            break
    where = [int(m.group(1)) for line in lines if line.startswith(f"[default{rank}]:")
             for m in [re.search(r'File "' + re.escape(path) + r'", line (\d+)', line)] if m]
    return {"rank": rank, "error": error, "line": where[-1]}

# plausible wrong readings
def flight_names_the_waiting_rank(dumps):
    answer = diagnose_flight(dumps)
    return {**answer, "rank": 1 - answer["rank"]}

def detail_counts_from_0(message):
    answer = diagnose_detail(message)
    return {**answer, "collective": answer["collective"] - 1}

def unused_first_name_only(message):
    return set(sorted(unused_names(message))[:1])

def stacks_outermost_frame(stacks, path):
    answer = diagnose_stacks(stacks, path)
    return {**answer, "function": "main"}

def torchrun_first_error_line(output, path):
    answer = diagnose_torchrun(output, path)
    return {**answer, "line": answer["line"] + 2}

def stub(*args):
    raise NotImplementedError()
'''

#: checker, the reference's name, a plausible wrong reading, and what its failure names.
CASES = {
    "flight": (debugging.flight_dump, "diagnose_flight", "flight_names_the_waiting_rank",
               "got the rank wrong"),
    "detail": (debugging.detail_mismatch, "diagnose_detail", "detail_counts_from_0",
               "SequenceNumber counts from 0"),
    "unused": (debugging.unused_parameters, "unused_names", "unused_first_name_only",
               "got the parameters wrong"),
    "stacks": (debugging.stuck_stack, "diagnose_stacks", "stacks_outermost_frame",
               "got the function or line wrong"),
    "torchrun": (debugging.torchrun_logs, "diagnose_torchrun", "torchrun_first_error_line",
                 "got the line wrong"),
}


@pytest.fixture(scope="module", autouse=True)
def one_variant_per_kind():
    """Each checker runs one variant per kind for the whole module (seconds each, torchrun's
    more): the first call runs it for real, the later ones read the same output."""
    made, ran = {}, {}
    variant, run = debugging.variant, debugging.Mystery.run

    def cached_variant(kind, differs):
        if kind not in made:
            made[kind] = variant(kind, differs)
        return made[kind]

    def cached_run(self, lab=None):
        if id(self) not in ran:
            ran[id(self)] = run(self, lab)
        return ran[id(self)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(debugging, "variant", cached_variant)
        patch.setattr(debugging.Mystery, "run", cached_run)
        yield


@pytest.fixture(scope="module")
def readings():
    namespace = {"__name__": "__main__"}
    exec(REFERENCE, namespace)
    return namespace


def test_seed_0_is_the_same_program_every_time_and_other_seeds_vary():
    for kind in mysteries.KINDS:
        shown = mysteries.make(kind, 0)
        assert mysteries.make(kind, 0).source == shown.source          # the same page every run
        assert len({str(mysteries.make(kind, seed).truth) for seed in range(20)}) > 2, kind


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_reference_passes_and_a_wrong_reading_fails(kind, fresh_lab, readings, capsys):
    checker, reference, wrong, named = CASES[kind]
    checker(readings[reference])
    assert last_line(capsys).startswith("Correct: your reading of"), kind
    fails(lambda: checker(readings[wrong]), "on a variant of the program", named)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_stub_fails_naming_what_it_raised(kind, fresh_lab, readings):
    checker = CASES[kind][0]
    message = fails(lambda: checker(readings["stub"]), "It raised when the check called", "a variant")
    assert message.startswith("NotImplementedError"), message


@pytest.mark.parametrize("kind", sorted(CASES))
def test_returning_the_shown_answer_fails(kind, fresh_lab):
    """The bypass: copy the diagnosis of the program the notebook shows (seed 0)."""
    truth = mysteries.make(kind, 0).truth
    answer = truth["parameters"] if kind == "unused" else truth
    namespace = {"__name__": "__main__", "answer": answer}
    exec("def copied(*args):\n    return answer\n", namespace)
    fails(lambda: CASES[kind][0](namespace["copied"]), "on a variant of the program", "wrong")


def test_a_value_instead_of_a_function_names_the_call(fresh_lab):
    fails(lambda: debugging.flight_dump({"rank": 0}), "needs your function",
          "ddplab.check.flight_dump(your_function)")
