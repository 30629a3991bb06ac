"""Checkers of notebook 02 (collectives): each accepts right answers and rejects wrong ones.

The student's function is defined on the ranks of a real 4-rank gloo lab, as
a %%ranks cell would, and the checker is called the way a check cell calls it.
"""

from __future__ import annotations

import pytest

from ddplab import check as collectives

pytestmark = pytest.mark.slow


def define(lab, source: str) -> None:
    """What the student's %%ranks exercise cell does: define a function on every rank."""
    lab.run_cell(source)


def fails(checker, *needles: str, **kwargs) -> str:
    """Run a checker that must reject the answer; return its message after checking key words."""
    with pytest.raises(AssertionError) as info:
        checker(**kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


# ----------------------------------------------------------------- global_mean
SUM_AND_COUNT = ("t = torch.stack([losses.sum(), torch.tensor(float(losses.numel()))])\n"
                 "    dist.all_reduce(t)\n    return t[0] / t[1]")


@pytest.mark.parametrize("body", [
    SUM_AND_COUNT,
    "t = torch.tensor([losses.sum().item(), len(losses)], dtype=torch.float64)\n"
    "    dist.all_reduce(t)\n    return (t[0] / t[1]).item()",
])
@pytest.mark.exercise("global_mean", "alternative")
def test_global_mean_accepts_right_answers(fresh_lab4, capsys, body):
    define(fresh_lab4, f"def global_mean(losses):\n    {body}\n")
    collectives.global_mean()
    assert capsys.readouterr().out.splitlines()[-1] == \
        "Correct: global_mean(losses) gives every rank the mean over all samples, and leaves losses alone."


@pytest.mark.exercise("global_mean", "mistake", "the mean of the ranks' means")
def test_global_mean_rejects_the_mean_of_means(fresh_lab4):
    define(fresh_lab4, "def global_mean(losses):\n    m = losses.mean().reshape(1)\n"
                       "    dist.all_reduce(m, op=dist.ReduceOp.AVG)\n    return m\n")
    message = fails(collectives.global_mean, "global_mean(losses) with losses = ",
                    "is wrong on ranks 0, 1, 2, 3", "<-- wrong", "Hint: the mean of the ranks' means")
    assert "rank 3: expected" in message


@pytest.mark.exercise("global_mean", "mistake", "the local mean")
def test_global_mean_rejects_the_local_mean(fresh_lab4):
    define(fresh_lab4, "def global_mean(losses):\n    return losses.mean()\n")
    fails(collectives.global_mean, "is wrong on ranks 0, 1, 2, 3")


@pytest.mark.exercise("global_mean", "mistake", "a reduce only rank 0 gets")
def test_global_mean_rejects_a_reduce_that_only_rank_0_gets(fresh_lab4):
    define(fresh_lab4, "def global_mean(losses):\n    t = torch.stack([losses.sum(), "
                       "torch.tensor(float(losses.numel()))])\n    dist.reduce(t, dst=0)\n"
                       "    return t[0] / t[1]\n")
    fails(collectives.global_mean, "is wrong on ranks 1, 2, 3.")


@pytest.mark.exercise("global_mean", "mistake", "reduces losses in place")
def test_global_mean_rejects_changing_losses(fresh_lab4):
    define(fresh_lab4, "def global_mean(losses):\n    s = losses[:1]\n    s[0] = losses.sum()\n"
                       "    n = torch.tensor([float(losses.numel())])\n    dist.all_reduce(s)\n"
                       "    dist.all_reduce(n)\n    return s[0] / n[0]\n")
    fails(collectives.global_mean, "losses after global_mean(losses) is wrong", "reduce a new tensor")


def test_a_missing_function_names_the_fix(fresh_lab4):
    fresh_lab4.run_cell("global_mean = None")
    fails(collectives.global_mean, "no function `global_mean` on ranks 0, 1, 2, 3", "%%ranks")


@pytest.mark.exercise("global_mean", "stub")
def test_a_function_that_raises_fails_the_check_with_its_traceback(fresh_lab4):
    define(fresh_lab4, "def global_mean(x):\n    raise NotImplementedError()\n")
    message = fails(collectives.global_mean,
                    "NotImplementedError (your %%ranks cell, line 2, in global_mean), on ranks 0, 1, 2, 3.",
                    "Your code's traceback (rank 0):\n  your %%ranks cell, line 2, in global_mean\n"
                    "    raise NotImplementedError()")
    assert message.startswith("NotImplementedError"), message    # the student's exception first


def test_a_deadlock_fails_the_check_with_where_ranks_wait(fresh_lab4):
    define(fresh_lab4, "def global_mean(x):\n    m = x.clone()\n    if rank == 0:\n"
                       "        dist.all_reduce(m)\n    return m\n")
    message = fails(collectives.global_mean, "did not finish", "deadlock", "lab.restart()", timeout=5)
    assert "rank 0: still in all_reduce" in message
    fresh_lab4.restart()


# ---------------------------------------------------------------- max_and_rank
GATHER_OBJECTS = """
def max_and_rank(value):
    pairs = [None] * world_size
    dist.all_gather_object(pairs, (value, rank))
    best = max(value for value, _ in pairs)
    return best, min(r for v, r in pairs if v == best)
"""

GATHER_TENSOR = """
def max_and_rank(value):
    everyone = torch.zeros(world_size, dtype=torch.float64)
    dist.all_gather_single(everyone, torch.tensor([value], dtype=torch.float64))
    best = torch.argmax(everyone)
    return everyone[best], best
"""


@pytest.mark.exercise("max_and_rank", "alternative")
@pytest.mark.parametrize("source", [GATHER_OBJECTS, GATHER_TENSOR])
def test_max_and_rank_accepts_right_answers(fresh_lab4, capsys, source):
    define(fresh_lab4, source)
    collectives.max_and_rank()
    assert capsys.readouterr().out.splitlines()[-1] == \
        "Correct: every rank knows the largest value and which rank holds it."


@pytest.mark.exercise("max_and_rank", "mistake", "its own rank")
def test_max_and_rank_rejects_its_own_rank(fresh_lab4):
    define(fresh_lab4, "def max_and_rank(value):\n    t = torch.tensor([value])\n"
                       "    dist.all_reduce(t, op=dist.ReduceOp.MAX)\n    return t.item(), rank\n")
    fails(collectives.max_and_rank, "max_and_rank(value) with value = ", "<-- wrong", "Hint: a MAX")


@pytest.mark.exercise("max_and_rank", "mistake", "the largest rank on a tie")
def test_max_and_rank_rejects_the_largest_rank_on_a_tie(fresh_lab4):
    define(fresh_lab4, GATHER_OBJECTS.replace("min(r for", "max(r for"))
    message = fails(collectives.max_and_rank, "is wrong on ranks 0, 1, 2, 3")
    assert "expected (" in message and ", 1)" in message


@pytest.mark.exercise("max_and_rank", "mistake", "a running max from zero")
def test_max_and_rank_rejects_a_running_max_from_zero(fresh_lab4):
    define(fresh_lab4, """
def max_and_rank(value):
    pairs = [None] * world_size
    dist.all_gather_object(pairs, (value, rank))
    best, who = 0.0, 0
    for v, r in pairs:
        if v > best:
            best, who = v, r
    return best, who
""")
    message = fails(collectives.max_and_rank, "is wrong on ranks 0, 1, 2, 3")
    assert "got      (0.0, 0)" in message


@pytest.mark.exercise("max_and_rank", "mistake", "the value without its rank")
def test_max_and_rank_rejects_a_value_without_its_rank(fresh_lab4):
    define(fresh_lab4, "def max_and_rank(value):\n    t = torch.tensor([value])\n"
                       "    dist.all_reduce(t, op=dist.ReduceOp.MAX)\n    return t.item()\n")
    fails(collectives.max_and_rank, "is wrong on ranks 0, 1, 2, 3")


# ------------------------------------------------------------------ parity_sum
PARITY = """
evens = dist.new_group(list(range(0, world_size, 2)))
odds = dist.new_group(list(range(1, world_size, 2)))

def parity_sum(x):
    total = x.clone()
    dist.all_reduce(total, group=evens if rank % 2 == 0 else odds)
    return total
"""


def test_parity_sum_accepts_the_right_answer(fresh_lab4, capsys):
    define(fresh_lab4, PARITY)
    collectives.parity_sum()
    assert capsys.readouterr().out.splitlines()[-1] == \
        "Correct: each rank holds the sum over the ranks of its own parity."


@pytest.mark.exercise("parity_sum", "mistake", "a sum over every rank")
def test_parity_sum_rejects_a_sum_over_everyone(fresh_lab4):
    define(fresh_lab4, "def parity_sum(x):\n    total = x.clone()\n    dist.all_reduce(total)\n"
                       "    return total\n")
    fails(collectives.parity_sum, "parity_sum(x) with x = ", "is wrong on ranks 0, 1, 2, 3", "new_group")


@pytest.mark.exercise("parity_sum", "mistake", "halves instead of parity")
def test_parity_sum_rejects_halves_instead_of_parity(fresh_lab4):
    define(fresh_lab4, PARITY.replace("list(range(0, world_size, 2))", "[0, 1]")
                             .replace("list(range(1, world_size, 2))", "[2, 3]")
                             .replace("rank % 2 == 0", "rank < 2"))
    fails(collectives.parity_sum, "is wrong on ranks 0, 1, 2, 3")


@pytest.mark.exercise("parity_sum", "mistake", "reduces x in place")
def test_parity_sum_rejects_changing_x(fresh_lab4):
    define(fresh_lab4, PARITY.replace("total = x.clone()", "total = x"))
    fails(collectives.parity_sum, "x after parity_sum(x) is wrong on ranks 0, 1, 2, 3")


# ------------------------------------------------------------- rows_to_columns
ROWS_TO_COLUMNS = """
def rows_to_columns(block):
    pieces = list(block.chunk(world_size, dim=1))
    arrived = [torch.empty_like(piece) for piece in pieces]
    dist.all_to_all(arrived, pieces)
    return torch.cat(arrived, dim=0)
"""


def test_rows_to_columns_accepts_the_right_answer(fresh_lab4, capsys):
    define(fresh_lab4, ROWS_TO_COLUMNS)
    collectives.rows_to_columns()
    assert capsys.readouterr().out.splitlines()[-1] == \
        "Correct: every rank turned its block of rows into its block of columns."


@pytest.mark.exercise("rows_to_columns", "alternative")
def test_rows_to_columns_accepts_all_to_all_single(fresh_lab4, capsys):
    define(fresh_lab4, """
def rows_to_columns(block):
    k, width = block.shape[0], block.shape[1] // world_size
    send = block.reshape(k, world_size, width).transpose(0, 1).contiguous()
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send)
    return out.reshape(world_size * k, width)
""")
    collectives.rows_to_columns()
    assert capsys.readouterr().out.startswith("Correct:")


@pytest.mark.exercise("rows_to_columns", "mistake", "its own pieces, never exchanged")
def test_rows_to_columns_rejects_local_pieces(fresh_lab4):
    define(fresh_lab4, "def rows_to_columns(block):\n"
                       "    return block.chunk(world_size, dim=1)[rank].repeat(world_size, 1)\n")
    fails(collectives.rows_to_columns, "rows_to_columns(block) with block shape [1, 4]", "<-- wrong")


@pytest.mark.exercise("rows_to_columns", "mistake", "joined along the wrong dimension")
def test_rows_to_columns_rejects_the_wrong_dimension(fresh_lab4):
    define(fresh_lab4, ROWS_TO_COLUMNS.replace("torch.cat(arrived, dim=0)", "torch.cat(arrived, dim=1)"))
    fails(collectives.rows_to_columns, "is wrong on ranks 0, 1, 2, 3")


@pytest.mark.exercise("rows_to_columns", "mistake", "pieces in the wrong order")
def test_rows_to_columns_rejects_pieces_in_the_wrong_order(fresh_lab4):
    define(fresh_lab4, ROWS_TO_COLUMNS.replace("torch.cat(arrived, dim=0)",
                                               "torch.cat(arrived[::-1], dim=0)"))
    fails(collectives.rows_to_columns, "is wrong on ranks 0, 1, 2, 3")


@pytest.mark.exercise("global_mean", "bypass")
def test_an_answer_read_from_the_checkers_frame_does_not_pass(fresh_lab4):
    """Issue 46: every rank was sent every rank's input, in the frame that called the student's
    function; an answer read from there, with no collective at all, passed."""
    define(fresh_lab4, "def global_mean(losses):\n    import sys\n"
                       "    inputs = sys._getframe(1).f_locals.get('inputs') or [losses]\n"
                       "    return torch.cat(list(inputs)).mean()\n")
    fails(collectives.global_mean, "is wrong on ranks")
