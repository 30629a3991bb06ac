"""The notebook 07 checker: its expected answer against a real two-node torchrun job, and
right/wrong answers."""

from __future__ import annotations

import textwrap

import pytest

import ddplab
from ddplab import launch
from ddplab.check.multinode import NNODES, NPROC_PER_NODE, expected_printers

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
    assert f"if {guard}:" in message and f"got            {sorted(wrong)!r}" in message
    assert words in message


def test_who_prints_names_a_missing_key_and_the_unfilled_placeholder():
    with pytest.raises(AssertionError, match="no entry for 'rank == 0'"):
        ddplab.check.who_prints({k: v for k, v in RIGHT.items() if k != "rank == 0"})
    with pytest.raises(AssertionError, match=r"got            Ellipsis"):
        ddplab.check.who_prints(dict(RIGHT, **{"rank == 0": ...}))
