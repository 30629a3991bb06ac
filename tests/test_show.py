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
