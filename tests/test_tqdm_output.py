"""A tqdm.auto bar in a rank cell ends, in the stored output, at its final state (issue 30)."""

from __future__ import annotations

import pytest

from ddplab.rank import output

pytestmark = pytest.mark.slow


def test_settled_leaves_ordinary_displays_alone():
    data = {"text/plain": "x", "text/html": "<b>x</b>"}
    assert output.settled(data) is data


def test_settled_drops_a_widget_that_is_gone():
    assert output.settled({output.WIDGET_VIEW: {"model_id": "no-such-model"},
                           "text/plain": "  0%|          | 0/20"}) is None


BAR = """
from tqdm.auto import tqdm
for _ in tqdm(range(20), bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}"):
    pass
"""


def test_a_tqdm_auto_bar_on_a_rank_is_replayed_at_its_end(fresh_lab, capsys):
    fresh_lab.run_cell(BAR)
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}]" in out
    assert out.count("20/20") == 2, out
    assert "0/20" not in out.replace("20/20", ""), out


DEFAULT_BAR = """
from tqdm.auto import tqdm
for _ in tqdm(range(20)):
    pass
"""


def test_a_default_tqdm_bar_is_stored_the_same_every_run(fresh_lab, capsys):
    """tqdm's default format ends in this run's timings ("[00:01<00:00, 19.5it/s]"): nbval's sanitize
    file replaces them, so the stored output is the bar's final state and nothing that varies."""
    from ddplab.grade.compare import sanitize, sanitize_patterns
    fresh_lab.run_cell(DEFAULT_BAR)
    out = sanitize(capsys.readouterr().out, sanitize_patterns())
    assert out.count("100%|██████████| 20/20 [TIME]") == 2, out
    assert "it/s" not in out and "0/20" not in out.replace("20/20", ""), out
