"""The notebook 07 checker: its expected answer against a real two-node torchrun job, and
right/wrong answers."""

from __future__ import annotations

import textwrap

import pytest

import ddplab
from ddplab import launch
from ddplab.check.nb07_multi_node import NNODES, NPROC_PER_NODE, expected_printers

pytestmark = pytest.mark.slow

RIGHT = {"local_rank == 0": [0, 3], "rank == 0": [0],
         "local_rank == local_world_size - 1": [2, 5],
         "local_rank == 0 with --virtual-local-rank": [0, 1, 2, 3, 4, 5]}

SCRIPT = """
import os
from ddplab.launch import report_env

rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
last = int(os.environ["LOCAL_WORLD_SIZE"]) - 1
report_env(local0=local == 0, rank0=rank == 0, last=local == last)
"""


def _printers(result, key):
    return sorted(rank for rank, report in result.reports.items() if report[key])


def test_expected_answer_is_what_real_torchrun_workers_see(tmp_path, monkeypatch):
    script = tmp_path / "guards.py"
    script.write_text(textwrap.dedent(SCRIPT))
    plain = launch.torchrun(str(script), nproc_per_node=NPROC_PER_NODE, nnodes=NNODES, timeout=120)
    expected = expected_printers()
    assert _printers(plain, "local0") == expected["local_rank == 0"]
    assert _printers(plain, "rank0") == expected["rank == 0"]
    assert _printers(plain, "last") == expected["local_rank == local_world_size - 1"]
    monkeypatch.setenv("PET_VIRTUAL_LOCAL_RANK", "1")       # torchrun --virtual-local-rank
    virtual = launch.torchrun(str(script), nproc_per_node=NPROC_PER_NODE, nnodes=NNODES, timeout=120)
    assert _printers(virtual, "local0") == expected["local_rank == 0 with --virtual-local-rank"]


def test_who_prints_accepts_the_right_answer_in_any_order(capsys):
    answer = dict(RIGHT, **{"local_rank == 0": {3, 0}})
    ddplab.check.who_prints(answer)
    assert capsys.readouterr().out == \
        "Correct: you know which of the 6 processes print under each guard.\n"


@pytest.mark.parametrize("guard, wrong, words", [
    ("local_rank == 0", [0], "once per node"),
    ("local_rank == local_world_size - 1", [2], "node_rank * nproc_per_node"),
    ("local_rank == 0 with --virtual-local-rank", [0, 3], "LOCAL_RANK=0"),
    ("rank == 0", [0, 3], "exactly one process"),
])
def test_who_prints_rejects_a_wrong_guard_with_its_hint(guard, wrong, words):
    with pytest.raises(AssertionError) as info:
        ddplab.check.who_prints(dict(RIGHT, **{guard: wrong}))
    message = str(info.value)
    assert message.startswith("who_prints is wrong for 1 of 4 guards on 2 nodes x 3 processes")
    assert f"  if {guard}: got {sorted(wrong)!r}   <-- wrong\n" in message, message
    assert words in message
    assert "expected" not in message and repr(RIGHT[guard]) not in message   # never the ranks


def test_who_prints_names_a_missing_key_and_the_unfilled_placeholder():
    with pytest.raises(AssertionError, match="no entry for 'rank == 0'"):
        ddplab.check.who_prints({k: v for k, v in RIGHT.items() if k != "rank == 0"})
    with pytest.raises(AssertionError, match=r"if rank == 0: got Ellipsis"):
        ddplab.check.who_prints(dict(RIGHT, **{"rank == 0": ...}))


# ----------------------------------------------------------------- physical_gpu
def right_physical_gpu(index, visible):
    if visible is None:
        return index
    ids = [int(v) for v in visible.split(",") if v]
    return ids[index] if index < len(ids) else None


def test_physical_gpu_accepts_the_visible_list_lookup(capsys):
    ddplab.check.physical_gpu(right_physical_gpu)
    out = capsys.readouterr().out
    assert out.startswith("Correct: cuda:i is the i-th GPU CUDA_VISIBLE_DEVICES lists.")
    assert "--virtual-local-rank: workers use GPUs [4, 5, 6, 7]" in out


@pytest.mark.parametrize("wrong, case", [
    (lambda index, visible: index, ("physical_gpu(0, '2,3')", "2", "0")),           # ignores it
    (lambda index, visible: right_physical_gpu(index, None if visible is None else
                                               ",".join(sorted(visible.split(",")))),
     ("physical_gpu(0, '1,0')", "1", "0")),                                          # sorts it
    (lambda index, visible: index if visible is None else int(visible.split(",")[index]),
     ("physical_gpu(2, '2,3')", "None", "'raised IndexError")),                      # no bound
])
def test_physical_gpu_rejects(wrong, case):
    with pytest.raises(AssertionError, match=r"(?s)physical_gpu is wrong in \d of 9 cases.*Hint: "):
        ddplab.check.physical_gpu(wrong)
    with pytest.raises(AssertionError) as info:
        ddplab.check.physical_gpu(wrong)
    label, expected, got = case
    pad = " " * len(label)
    assert f"  {label}: expected {expected}\n  {pad}  got      {got}" in str(info.value), str(info.value)


def test_physical_gpu_names_a_missing_function():
    with pytest.raises(AssertionError, match="physical_gpu must be a function"):
        ddplab.check.physical_gpu(None)


def _right_only_on_a_rank(index, visible):
    """Right on a lab's rank, wrong anywhere else: shows where the checker ran it."""
    from ddplab.rank.engine import in_lab
    return right_physical_gpu(index, visible) if in_lab() else -1


def test_physical_gpu_runs_the_function_on_rank_0_of_a_running_lab(fresh_lab, capsys):
    """Where a grader can check it without running the student's code itself
    (ddplab.grade.witness); with no lab it runs here (the tests above)."""
    ddplab.check.physical_gpu(_right_only_on_a_rank)
    assert capsys.readouterr().out.startswith("Correct: cuda:i is the i-th GPU")
