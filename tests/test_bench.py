"""ddplab.bench: nccl-tests' definitions, the α-β fit, and real timings on real ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddplab import bench


def test_busbw_factors_are_nccl_tests():
    assert bench.busbw_factor("all_reduce", 4) == 1.5          # 2(n-1)/n
    assert bench.busbw_factor("all_reduce", 2) == 1.0
    assert bench.busbw_factor("broadcast", 4) == 1.0
    assert bench.busbw_factor("all_gather", 4) == 0.75         # (n-1)/n
    with pytest.raises(ValueError, match="no bus bandwidth factor for 'gather'; use one of"):
        bench.busbw_factor("gather", 4)


def test_result_bandwidths():
    r = bench.Result("all_reduce", "ring", 4, 16 << 20, 0.01)
    assert r.algbw == pytest.approx((16 << 20) / 0.01)
    assert r.busbw == pytest.approx(r.algbw * 1.5)


@pytest.mark.parametrize("text, nbytes", [("4K", 4096), ("64M", 64 << 20), ("16MB", 16 << 20),
                                          ("4", 4), (100, 100), ("1.5K", 1536)])
def test_parse_size(text, nbytes):
    assert bench.parse_size(text) == nbytes


def test_parse_size_names_the_fix():
    with pytest.raises(ValueError, match="cannot read the size 'lots'; write bytes like"):
        bench.parse_size("lots")


def test_fit_ring_recovers_a_known_model():
    alpha, beta = 50e-6, 1e-9
    results = [bench.Result("all_reduce", "ring", p, m, 2 * (p - 1) * (alpha + m / p * beta))
               for p in (2, 4) for m in (4096, 1 << 20, 16 << 20)]
    fit = bench.fit_ring(results)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta"] == pytest.approx(beta, rel=1e-6)
    # Noise that would make α negative: α is taken as 0 and β fitted alone.
    noisy = [bench.Result("all_reduce", "ring", 2, m, t) for m, t in ((4096, 1e-6), (1 << 20, 2e-3))]
    assert bench.fit_ring(noisy)["alpha"] == 0.0 and bench.fit_ring(noisy)["beta"] > 0
    with pytest.raises(ValueError, match="at least two sizes"):
        bench.fit_ring(results[:1])


def test_table_has_one_line_per_result():
    results = [bench.Result("broadcast", "dist.broadcast", 2, 4096, 2e-5)]
    lines = bench.table(results).splitlines()
    assert lines[0].split() == ["collective", "ranks", "implementation", "size", "time",
                                "algbw", "GB/s", "busbw", "GB/s"]
    assert lines[2].split() == ["broadcast", "2", "dist.broadcast", "4", "KB", "20.0", "us",
                                "0.205", "0.205"]


@pytest.mark.slow
def test_sweep_times_every_collective_on_real_ranks(fresh_lab):
    results = bench.sweep(fresh_lab, ["all_reduce", "broadcast", "all_gather"], ["4K", "64K"],
                          repeats=1)
    names = [(r.collective, r.name) for r in results]
    assert sorted(set(names)) == sorted([("all_reduce", "dist.all_reduce"), ("all_reduce", "naive"),
                                         ("all_reduce", "ring"), ("all_reduce", "recursive_doubling"),
                                         ("broadcast", "dist.broadcast"), ("all_gather", "dist.all_gather")])
    assert len(results) == 12 and all(r.seconds > 0 and r.world_size == 2 for r in results)
    assert [r.nbytes for r in results[:2]] == [4096, 65536]


@pytest.mark.slow
def test_sweep_times_a_students_function(fresh_lab):
    def my_all_reduce(tensor):
        import torch.distributed as dist
        dist.all_reduce(tensor)

    results = bench.sweep(fresh_lab, sizes=["4K"], repeats=1, extra={"mine": my_all_reduce})
    assert [r.name for r in results][-1] == "mine"


@pytest.mark.slow
def test_machine_measures_a_link_and_an_add(fresh_lab):
    link = bench.machine(fresh_lab, sizes=["4", "1M"], repeats=1)
    assert set(link) == {"alpha", "beta", "beta_add", "pingpong"}
    assert list(link["pingpong"]) == [4, 1 << 20]
    assert "ring fit, per step" in bench.model_table({"alpha": 1e-4, "beta": 1e-9}, link)


def test_plot_draws_time_and_busbw():
    import matplotlib
    matplotlib.use("Agg")
    results = [bench.Result("all_reduce", name, p, m, m * 1e-9 + 1e-5)
               for name in ("ring", "dist.all_reduce") for p in (2, 4) for m in (4096, 1 << 20)]
    results.append(bench.Result("broadcast", "dist.broadcast", 2, 4096, 1e-5))
    figure = bench.plot(results)
    left, right, below, _ = figure.axes                      # a row per collective
    assert left.get_ylabel() == "time per call (s)" and right.get_ylabel() == "busbw (GB/s)"
    assert left.get_title() == "all_reduce" and below.get_title() == "broadcast"
    assert len(right.lines) == 4                             # 2 implementations x 2 world sizes
    ring2, ring4 = right.lines[0], right.lines[1]
    assert ring2.get_color() == ring4.get_color() and ring2.get_linestyle() != ring4.get_linestyle()


@pytest.mark.slow
def test_command_line_prints_a_table():
    done = subprocess.run([sys.executable, "-m", "ddplab.bench", "--world-sizes", "2", "--sizes",
                           "4K", "64K", "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "collective  ranks  implementation" in out
    for name in ("dist.all_reduce", "ring", "naive", "recursive_doubling", "dist.broadcast",
                 "dist.all_gather"):
        assert f" {name} " in out
    assert "ring vs dist.all_reduce at 64 KB on 2 ranks: busbw" in out
    assert "ring fit, per step" in out and "send/recv, rank 0 -> 1" in out


def test_summary_on_one_rank_says_there_is_nothing_to_compare(capsys):
    # a 1-GPU nccl run (issue 60's H200): busbw is 0 on 1 rank, and the ratio divided by it
    results = [bench.Result("all_reduce", name, 1, size, 1e-5)
               for name in ("dist.all_reduce", "ring") for size in (1 << 20, 64 << 20)]
    bench._summary(results, None)
    assert "1 rank: no bus bandwidth to compare (nothing crosses a link)" in capsys.readouterr().out


def test_command_line_takes_the_backend_and_nccl_without_gpus_names_the_fix():
    """tools/gpu_check.sh times nccl with --backend nccl; here, with no GPU, ddplab.start refuses."""
    done = subprocess.run([sys.executable, "-m", "ddplab.bench", "--backend", "nccl", "--world-sizes",
                           "2", "--sizes", "4K"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "nccl" in done.stderr and "backend='gloo'" in done.stderr, done.stderr[-2000:]
