"""ddplab.show: a value from every rank as a rank x element grid, text and HTML."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ddplab


def test_show_draws_each_ranks_tensor_in_rank_order(fresh_lab):
    fresh_lab.run_cell("t = torch.arange(3) + 10 * rank")
    picture = ddplab.show("t")
    assert picture.values() == {0: (0, 1, 2), 1: (10, 11, 12)}
    assert repr(picture).splitlines() == [
        "t",
        "         0  1  2",
        "rank 0   0  1  2   int64[3]",
        "rank 1  10 11 12   int64[3]",
    ]
    html = picture._repr_html_()
    assert html.index("rank 0") < html.index("rank 1")
    assert ">12</td>" in html and "background:#08519c" in html   # the largest value is darkest


def test_show_before_and_after_side_by_side(fresh_lab):
    fresh_lab.run_cell("before = torch.tensor([rank + 1.0])\nafter = before.clone()\n"
                       "dist.all_reduce(after)")
    picture = ddplab.show("before", "after", titles=["before all_reduce", "after all_reduce"])
    assert picture.values(0) == {0: (1.0,), 1: (2.0,)}
    assert picture.values(1) == {0: (3.0,), 1: (3.0,)}
    text = repr(picture)
    assert text.index("before all_reduce") < text.index("after all_reduce")
    assert picture._repr_html_().count("<table") == 2


def test_show_lists_of_tensors_functions_and_scalars(fresh_lab):
    fresh_lab.run_cell("parts = [torch.tensor([rank, rank]), torch.tensor([9])]")
    assert "|" in repr(ddplab.show("parts")).splitlines()[2]      # a bar between list items
    picture = ddplab.show(lambda: dist.get_rank() * 0.5)
    assert picture.values() == {0: (0.0,), 1: (0.5,)}
    assert ddplab.show("None").values() == {0: (), 1: ()}
    assert ddplab.show("t", ranks=[1]).values() == {1: (10, 11, 12)}


def test_show_names_the_fix_for_bad_input(fresh_lab):
    import torch

    with pytest.raises(ddplab.ConfigError, match="name of a variable on the ranks"):
        ddplab.show(torch.ones(2))
    with pytest.raises(ddplab.ConfigError, match="something to draw"):
        ddplab.show()
    with pytest.raises(ddplab.RankError, match="define it in a %%ranks cell"):
        ddplab.show("no_such_variable")


def test_format_cell_is_short_and_stable():
    from ddplab.show import format_cell

    assert [format_cell(v) for v in (3.0, 2.5, 1 / 3, True, 7, float("nan"))] == \
        ["3", "2.5", "0.3333", "True", "7", "nan"]


def test_show_cuts_long_values_on_the_rank(fresh_lab):
    """Only the drawn columns and the figures about the rest travel: the picture of a
    long value equals that of its first 64 elements, plus its length, min and max."""
    fresh_lab.run_cell("long = torch.arange(100.0) + rank\nhead = long[:64].clone()\n"
                       "parts = [torch.arange(40) + rank, torch.arange(50)]\n"
                       "many = list(range(rank, rank + 70))")
    long, head = ddplab.show("long", titles=["x"]), ddplab.show("head", titles=["x"])
    assert long.values() == head.values() == {r: tuple(float(i + r) for i in range(64))
                                              for r in range(2)}
    assert repr(long).splitlines()[1] == repr(head).splitlines()[1]      # the column numbers
    for text, reference in zip(repr(long).splitlines()[2:], repr(head).splitlines()[2:]):
        drawn = reference.removesuffix("float32[64]")
        assert text.startswith(drawn) and text[len(drawn):].startswith("float32[100] ... (100 in all")
    assert repr(long).splitlines()[2].endswith("(100 in all, min 0, max 99)")
    assert repr(long).splitlines()[3].endswith("(100 in all, min 1, max 100)")
    assert long._repr_html_().replace("[100]", "[64]") == head._repr_html_()
    parts = ddplab.show("parts")
    assert parts.values()[1] == tuple(range(1, 41)) + tuple(range(24))
    assert repr(parts).splitlines()[2].endswith("list of 2 tensors ... (90 in all)")
    many = ddplab.show("many")
    assert many.values()[1] == tuple(range(1, 65))
    assert repr(many).splitlines()[3].endswith("list[70] ... (70 in all)")


@pytest.mark.slow
def test_show_of_a_huge_tensor_costs_the_kernel_little_memory(fresh_lab):
    """20M floats are 80 MB on each rank and were 1.9 GB as Python floats in the kernel."""
    import gc

    import psutil

    fresh_lab.run_cell("huge = torch.arange(20_000_000, dtype=torch.float32) * (rank + 1)")
    gc.collect()
    before = psutil.Process().memory_info().rss
    picture = ddplab.show("huge")
    grown = psutil.Process().memory_info().rss - before
    assert grown < 50 * 2**20, f"the kernel grew by {grown / 2**20:.0f} MB to draw 64 columns"
    assert picture.values() == {r: tuple(float(i * (r + 1)) for i in range(64)) for r in range(2)}
    import torch

    from ddplab.show import format_cell

    largest = format_cell((torch.arange(20_000_000, dtype=torch.float32)[-1:] * 2).item())
    assert repr(picture).splitlines()[3].endswith(
        f"float32[20000000] ... (20000000 in all, min 0, max {largest})")
    fresh_lab.run_cell("del huge")
