"""ddplab.plan: memory measured by torch's trackers on a fake group, α-β step times, the advice."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

import ddplab
from ddplab.errors import ConfigError
from ddplab.plan import CONFIGS, Config, Network, parse
from ddplab.plan.compute import Device, device
from ddplab.plan.network import Link, torch_guess
from ddplab.plan.step import collectives, step

TOY = Config("test-mlp", "mlp", layers=4, d_model=256, seq=16, batch=4)   # fp32, Adam


# ------------------------------------------------------------ strategies
def test_strategies_parse_and_compose():
    assert parse("fsdp").name == "fsdp"
    assert parse("fsdp+tp8") == parse("tp8+fsdp")
    s = parse("tp2+pp4+zero1")
    assert (s.data, s.tp, s.pp, s.replicas(64)) == ("zero1", 2, 4, 8)
    gpt = Config(layers=3, d_model=1024, head_dim=64, batch=8)              # 16 heads
    assert parse("tp8+fsdp").check(4, gpt) == "4 ranks are not a multiple of tp*pp = 8"
    assert parse("tp2+ddp").check(4, gpt).startswith("torch's DDP takes plain tensors, not tensor")
    assert parse("pp4+ddp").check(8, gpt) == "3 layers cannot fill 4 pipeline stages"
    assert parse("pp2+ddp").check(8, gpt.but(microbatch=8)).startswith("1 micro-batches cannot fill 2")
    assert parse("tp32+fsdp").check(32, gpt) == "16 heads (16 key/value heads) do not split over tp=32"
    assert parse("pp2+ddp").check(8, gpt) is None                       # 3 layers: 1 and 2, as torchtitan
    with pytest.raises(ConfigError, match="cannot read the strategy 'zero3'.*e.g. 'fsdp'"):
        parse("zero3")


# ------------------------------------------------------------ network
def test_ring_all_reduce_is_the_alpha_beta_formula():
    net = Network.from_bench({"alpha": 20e-6, "beta": 2e-10})
    for n, nbytes in ((2, 1 << 20), (8, 100e6), (1024, 4e9)):
        want = 2 * (n - 1) / n * nbytes * 2e-10 + 2 * (n - 1) * 20e-6
        assert net.seconds("all_reduce", nbytes, n) == pytest.approx(want, rel=1e-12)
        assert net.seconds("all_gather", nbytes, n) == pytest.approx(want / 2, rel=1e-12)
        assert net.seconds("reduce_scatter", nbytes, n) == pytest.approx(want / 2, rel=1e-12)
    tree = Network("t", Link(20e-6, 2e-10), Link(20e-6, 2e-10), algorithm="tree")
    assert tree.seconds("all_reduce", 0, 1024) == pytest.approx(2 * 10 * 20e-6)   # log2 latency
    assert net.seconds("all_reduce", 1e9, 1) == 0.0
    with pytest.raises(ConfigError, match="no α-β cost for 'gossip'"):
        net.seconds("gossip", 1, 2)


def test_a_named_interconnect_uses_the_slow_link_across_nodes():
    net = Network.named("nvlink+ib")
    inside, across = net.seconds("all_reduce", 1e9, 8), net.seconds("all_reduce", 1e9, 16)
    assert across > 5 * inside
    assert net.seconds("all_reduce", 1e9, 2, span=16) > net.seconds("all_reduce", 1e9, 2)
    with pytest.raises(ConfigError, match="no interconnect named 'carrier pigeon'"):
        Network.named("carrier pigeon")


def test_torch_guess_is_dtensors_cost_model():
    gib = 2**30
    # torch: 6.6 µs + hops * 0.6 µs (in a host) + bytes_gib * hops / n / 87.7 GB/s
    want = (6.6 + 14 * 0.6) * 1e-6 + 1.0 * 14 / 8 / 87.7
    assert torch_guess("all_reduce", gib, 8) == pytest.approx(want, rel=1e-9)
    across = (6.6 + 15 * 2.7) * 1e-6 + 1.0 * 15 / 16 / (87.7 * 0.22)
    assert torch_guess("all_gather", gib, 16) == pytest.approx(across, rel=1e-9)
    assert torch_guess("send", gib, 2) is None


# ------------------------------------------------------------ compute and step
def test_device_peaks_come_from_torch_where_it_has_them():
    h100 = device("h100", efficiency=0.5)
    assert "torch._inductor" in h100.source
    assert h100.flops["bfloat16"] == pytest.approx(1979e12 / 2)       # datasheet, sparsity removed
    assert h100.seconds(1e15, "bfloat16") == pytest.approx(1e15 / (1979e12 / 2 * 0.5))
    with pytest.raises(ConfigError, match="no device named 'tpu9'"):
        device("tpu9")


def test_step_time_splits_compute_communication_and_bubble():
    dev = Device("d", {"float32": 1e12}, 80e9, "test", efficiency=1.0)
    net = Network.from_bench({"alpha": 0.0, "beta": 1e-9})
    weights = TOY.parameters * 4
    ddp = step(parse("ddp"), TOY, 8, 3e12, TOY.parameters, dev, net)
    assert ddp.compute == pytest.approx(3.0)
    assert ddp.communication == pytest.approx(2 * 7 / 8 * weights * 1e-9)
    assert 0 < ddp.exposed <= ddp.communication                 # the last bucket at least
    fsdp = step(parse("fsdp"), TOY, 8, 3e12, TOY.parameters, dev, net)
    assert fsdp.communication == pytest.approx(1.5 * ddp.communication)   # ag, ag, rs
    pp = step(parse("pp2+ddp"), TOY, 4, 3e12 / TOY.batch, TOY.parameters // 2, dev, net)   # per micro-batch
    assert pp.compute == pytest.approx(3.0)
    assert pp.bubble == pytest.approx((2 - 1) / TOY.batch * 3.0)      # 1F1B: (P-1)/M
    interleaved = step(parse("pp2v2+ddp"), TOY, 4, 3e12 / TOY.batch, TOY.parameters // 2, dev, net)
    assert interleaved.bubble == pytest.approx((2 - 1) / (2 * TOY.batch) * 3.0)   # (P-1)/(V·M)
    zero2 = step(parse("zero2"), TOY, 8, 3e12, TOY.parameters, dev, net)
    assert zero2.communication == pytest.approx(ddp.communication)      # one all_gather, one reduce_scatter
    ops = [c[0] for c in collectives(parse("tp2+fsdp"), TOY, 4, TOY.parameters)]
    assert ops.count("all_reduce") == 4 * TOY.layers                 # 2 forward, 2 backward per layer
    assert ddp.total == pytest.approx(ddp.compute + ddp.exposed)
    shared = Device("cpu", {"float32": 1e12}, 80e9, "test", efficiency=1.0, overlap=False)
    on_cpu = step(parse("fsdp"), TOY, 8, 3e12, TOY.parameters, shared, net)
    assert on_cpu.exposed == on_cpu.communication and on_cpu.hidden == 0   # gloo shares the cores


# ------------------------------------------------------------ the model and the API
@pytest.mark.parametrize("name", ["toy", "gpt-tiny", "llm-1b", "llama3.1-8b", "llama3.1-405b"])
def test_configs_count_the_parameters_they_build(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = CONFIGS[name]
    with FakeTensorMode():
        built = sum(p.numel() for p in config.build().parameters())
    assert config.parameters == built


def test_the_llama_configs_are_llama_31s_shapes():
    """8.03B, 70.6B, 405.9B parameters, as Meta's model cards and torchtitan's configs give them."""
    names = ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")
    sizes = [CONFIGS[name].parameters / 1e9 for name in names]
    assert sizes == pytest.approx([8.03, 70.55, 405.85], abs=0.01)
    assert TOY.parameters == 4 * (2 * 256 * 1024 + 1024 + 256)


def test_plan_is_a_plain_function_and_takes_configs_not_modules():
    assert ddplab.plan is sys.modules["ddplab.plan"].plan and callable(ddplab.plan)
    with pytest.raises(ConfigError, match=r"cannot plan for .*Config\(layers=\.\.\., d_model=\.\.\.\) "
                                          r"\(from ddplab.plan import Config\)"):
        ddplab.plan(object())


# ------------------------------------------------------------ measured by torch (a child process)
@pytest.fixture(scope="module")
def traced():
    from ddplab.plan.children import measure

    return measure(TOY, [("ddp", 4), ("fsdp", 4), ("fsdp", 16), ("zero1", 4), ("pp2+ddp", 4),
                         ("tp2+zero2", 4), ("tp2+fsdp", 4), ("pp2+fsdp", 8)], timeout=600)


@pytest.mark.slow
def test_ddp_holds_16_bytes_per_parameter_with_adam_in_fp32(traced):
    state = traced[("ddp", 4)]["state"]
    per_parameter = (state["parameters"] + state["gradients"] + state["optimizer"]) / TOY.parameters
    assert per_parameter == pytest.approx(16, rel=0.01)               # 4 + 4 + 8 (exp_avg, exp_avg_sq)
    assert traced[("ddp", 4)]["activations"] > 0
    assert traced[("ddp", 4)]["peak"] >= sum(state.values())


@pytest.mark.slow
def test_fsdp_and_zero_shard_what_they_should(traced):
    full = traced[("ddp", 4)]["state"]
    for n in (4, 16):
        state = traced[("fsdp", n)]["state"]
        for kind in ("parameters", "gradients", "optimizer"):
            assert state[kind] == pytest.approx(full[kind] / n, rel=0.05), (n, kind)
    zero = traced[("zero1", 4)]["state"]
    assert zero["parameters"] == full["parameters"]
    assert zero["optimizer"] == pytest.approx(full["optimizer"] / 4, rel=0.2)   # whole tensors per rank
    assert traced[("pp2+ddp", 4)]["state"]["parameters"] == pytest.approx(full["parameters"] / 2, rel=0.01)
    assert traced[("tp2+zero2", 4)]["state"]["parameters"] == pytest.approx(full["parameters"] / 4, rel=0.01)
    assert traced[("tp2+zero2", 4)]["flops"] == traced[("ddp", 4)]["flops"] // 2
    both = traced[("tp2+fsdp", 4)]["state"]                             # tp 2, then fsdp over 2
    assert both["parameters"] == pytest.approx(full["parameters"] / 4, rel=0.01)
    staged = traced[("pp2+fsdp", 8)]["state"]                           # 2 stages, fsdp over 4
    assert staged["parameters"] == pytest.approx(full["parameters"] / 8, rel=0.02)
    # FlopCounterMode: forward 2·rows·weights, backward twice that (the weights' gradient and the
    # input's), less the first layer's input gradient: the batch needs none
    rows, weights = TOY.batch * TOY.seq, 4 * (2 * 256 * 1024)
    assert traced[("ddp", 4)]["flops"] == 3 * 2 * rows * weights - 2 * rows * 256 * 1024


@pytest.mark.slow
def test_a_plan_says_what_does_not_fit_and_what_would():
    tight = Device("tiny", {"float32": 1e12}, 20e6, "test")
    made = ddplab.plan(TOY, world_sizes=[1, 8], strategies=["ddp", "fsdp", "tp8+fsdp"], device=tight,
                       network={"alpha": 1e-5, "beta": 1e-9})
    assert not made.row("ddp", 8).fits(tight.memory) and made.row("fsdp", 8).fits(tight.memory)
    advice = made.advice()
    fitting = [r for r in made.rows if r.world_size == 8 and r.fits(tight.memory)]
    fastest = max(fitting, key=lambda r: r.tokens_per_s)
    assert fastest.tokens_per_s == pytest.approx(fastest.tokens / fastest.step.total)
    assert f"8 ranks: does not fit in 0.02 GB: ddp. fastest that fits: {fastest.strategy} (" in advice
    assert "1 ranks: does not fit" in advice and "nothing asked fits" in advice
    assert "not a multiple of tp*pp = 8" in made.table()          # tp8 at 1 rank: said, not raised
    import torch.distributed as dist
    assert not dist.is_initialized()          # the fake group lived in the children, not here
    assert math.isclose(made.row("fsdp", 8).step.compute, made.row("ddp", 8).step.compute)
    figure = made.picture()
    assert len(figure.axes) == 2


@pytest.mark.slow
def test_the_command_line_prints_a_plan():
    done = subprocess.run([sys.executable, "-m", "ddplab.plan", "toy", "--world-sizes", "2", "8",
                           "--strategies", "ddp", "fsdp", "--device", "a100"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "toy: 0.0021B parameters" in done.stdout and "fastest that fits" in done.stdout
    assert "Mtok/s" in done.stdout.splitlines()[2]                      # every column named


# ------------------------------------------------------------ the child's changes to torch
@pytest.mark.parametrize("size, n", [(10, 3), (10, 4), (3, 8), (1024, 1024), (7, 1), (2050, 64)])
def test_fsdp_chunks_made_one_at_a_time_are_torchs(size, n):
    """``patches.Chunks`` gives FSDP2 the chunk it asks for as torch.chunk (padded with empties to
    n, as FSDP's ``_chunk_with_empty``) gives it: the same values, shape and strides."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from ddplab.plan.patches import Chunks

    t = torch.arange(size * 3).view(size, 3)
    want, got = _chunk_with_empty(t, n, 0), Chunks(t, n, 0)
    assert len(got) == len(want) == n
    for i in sorted({0, 1 % n, n // 2, n - 1, -1}):
        assert got[i].shape == want[i].shape and got[i].stride() == want[i].stride(), i
        assert torch.equal(got[i], want[i]), i
    assert [c.shape for c in got[1:3]] == [c.shape for c in want[1:3]]


def test_one_chunk_each_is_in_place_while_it_lasts():
    """Not a silent fallback on this torch: FSDP2's chunking is swapped, then put back."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from ddplab.plan.patches import Chunks, one_chunk_each

    own = _fsdp_param._chunk_with_empty
    with one_chunk_each():
        import torch
        assert isinstance(_fsdp_param._chunk_with_empty(torch.zeros(8, 2), 4, 0), Chunks)
    assert _fsdp_param._chunk_with_empty is own


@pytest.mark.slow
def test_a_trace_with_fsdps_chunks_made_one_at_a_time_measures_the_same(monkeypatch):
    """The plan at 16 ranks with ``one_chunk_each`` and with torch's own chunking: every number equal.
    (fsdp: a tp+fsdp case's peak depends on what the process traced before, with either.)"""
    import contextlib

    from ddplab.plan import memory

    fast = memory.trace(TOY, parse("fsdp"), 16)
    monkeypatch.setattr(memory, "one_chunk_each", contextlib.nullcontext)
    assert memory.trace(TOY, parse("fsdp"), 16) == fast


def test_a_plan_calibrated_on_one_measured_step_reads_the_others():
    """at_efficiency re-times every row from its FLOPs (no tracing); calibrated finds the efficiency
    at which one row trains what was measured."""
    from ddplab.plan import Plan, Row

    dev = Device("d", {"float32": 1e12}, 80e9, "test", efficiency=0.5)
    net = Network.from_bench({"alpha": 1e-5, "beta": 1e-9})
    rows = [Row(s, n, step=step(parse(s), TOY, n, 3e12, TOY.parameters, dev, net), flops=int(3e12),
                parameters=TOY.parameters, tokens=n * TOY.batch * TOY.seq)
            for s, n in (("ddp", 8), ("fsdp", 64))]
    made = Plan(TOY, dev, net, rows)
    measured = 0.8 * made.row("ddp", 8).tokens_per_gpu            # the real step was slower
    efficiency = made.calibrated(made.row("ddp", 8), measured)
    again = made.at_efficiency(efficiency)
    assert again.row("ddp", 8).tokens_per_gpu == pytest.approx(measured, rel=1e-6)
    assert efficiency < 0.5 and again.device.efficiency == efficiency
    assert again.row("fsdp", 64).step.compute == pytest.approx(3.0 / efficiency)
    with pytest.raises(ConfigError, match="Did you mean 0.40"):
        made.at_efficiency(40)
