"""The reference all_reduce implementations, against dist.all_reduce, on 1 to 4 real ranks."""

from __future__ import annotations

import pytest
from conftest import side_lab

import ddplab
from ddplab import algorithms
from ddplab.check.nb06_build_all_reduce import methods as check

pytestmark = pytest.mark.slow



# ddplab's own: the checks below pass refuse_reference=False (an answer may not run these).
IMPLEMENTATIONS = [algorithms.naive_all_reduce_collectives, algorithms.naive_all_reduce,
                   algorithms.ring_all_reduce, algorithms.recursive_doubling_all_reduce]


def _small_lab(world_size):
    return side_lab(world_size, timeout=120)


@pytest.fixture(scope="module")
def lab1():
    """world_size 1: every algorithm must reduce to 'do nothing' without sending to itself."""
    lab = _small_lab(1)
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def lab3():
    """3 ranks: not a power of two (recursive doubling folds a rank in) and odd chunk counts."""
    lab = _small_lab(3)
    yield lab
    lab.stop()


@pytest.mark.parametrize("fn", IMPLEMENTATIONS, ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("labname", ["lab1", "fresh_lab", "lab3", "fresh_lab4"])
def test_matches_dist_all_reduce(fn, labname, request, capsys):
    lab = request.getfixturevalue(labname)
    check.check_all_reduce(fn, fn.__name__, forbidden=(), lab=lab, refuse_reference=False)
    assert f"Correct: {fn.__name__} matches dist.all_reduce" in capsys.readouterr().out


def test_send_recv_versions_use_no_collective(fresh_lab4, capsys):
    for fn in IMPLEMENTATIONS[1:]:
        check.check_all_reduce(fn, fn.__name__, lab=fresh_lab4,       # collectives forbidden
                               refuse_reference=False)
    assert capsys.readouterr().out.count("Correct:") == 3


def test_half_precision_and_bool_like_dtypes(fresh_lab4):
    extra = [((n,), dtype, 0) for n in (5, 64) for dtype in ("float16", "bfloat16", "int8", "uint8")]
    for fn in IMPLEMENTATIONS[1:]:
        check.check_all_reduce(fn, fn.__name__, lab=fresh_lab4, case_list=extra, refuse_reference=False)


def test_non_contiguous_tensor_is_refused_with_the_fix(fresh_lab):
    def transposed():
        import torch
        algorithms.ring_all_reduce(torch.ones(3, 4).t())

    with pytest.raises(ddplab.RankError, match="contiguous"):
        fresh_lab.run(transposed)


def test_ring_trace_follows_the_ring(fresh_lab4):
    traces = fresh_lab4.run(algorithms.trace_ring, 6)
    p = 4
    for rank, trace in enumerate(traces):
        assert [(e["phase"], e["step"]) for e in trace] == [("start", 0)] + [
            (phase, s) for phase in ("reduce-scatter", "all-gather") for s in (1, 2, 3)]
        assert trace[0]["buffer"] == [10 ** rank] * 6
        for entry in trace[1:]:
            assert entry["to"] == (rank + 1) % p and entry["source"] == (rank - 1) % p
        assert [e["sent"] for e in trace[1:4]] == [(rank - s) % p for s in range(3)]
        assert [e["received"] for e in trace[4:]] == [(rank - s) % p for s in range(3)]
        assert trace[-1]["buffer"] == [1111] * 6
    # After the reduce-scatter rank r holds the full sum of chunk (r + 1) % p.
    chunks = [[0, 1], [2, 3], [4], [5]]                       # tensor_split(6 elements, 4)
    for rank, trace in enumerate(traces):
        done = chunks[(rank + 1) % p]
        assert [trace[3]["buffer"][i] for i in done] == [1111] * len(done)


def test_ring_picture_text_is_deterministic(fresh_lab4):
    picture = algorithms.ring_picture(fresh_lab4.run(algorithms.trace_ring, 6))
    text = repr(picture)
    assert len(picture.grids) == 7
    assert text.startswith("before: rank r holds 10**r everywhere")
    assert "reduce-scatter, step 1 of 3" in text and "all-gather, step 3 of 3" in text
    assert "sent chunk 0 to rank 1, added chunk 3 from rank 3" in text
    assert picture.values(6) == {rank: (1111,) * 6 for rank in range(4)}
    assert "|" in text                                        # bars between chunks
    assert repr(algorithms.ring_picture(fresh_lab4.run(algorithms.trace_ring, 6))) == text
