"""ddplab.plan refuses every bad argument before any tracing starts, each with its fix.

Each case here was found by an adversarial pass (issue 56): before, efficiency=0 traced the whole
model and then raised ZeroDivisionError, NaN or negative values gave NaN or negative step times
that advice() called the fastest, world_sizes=8 or ['8'] failed with raw errors, [-1] traced for
49 s, strategies="ddp" read as 'd', 'tp2+tp2+fsdp' silently became 'tp2+fsdp'.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import ddplab
from ddplab.errors import ConfigError, DdplabError
from ddplab.plan import Config, parse

plan_package = sys.modules["ddplab.plan"]


@pytest.fixture
def nothing_traced(monkeypatch):
    """Fail the test if the plan gets as far as tracing."""
    def traced(*args, **kwargs):
        raise AssertionError("the plan started tracing before refusing its input")
    monkeypatch.setattr(plan_package, "measure", traced)


def refused(match: str, **arguments) -> None:
    options = {"model": "toy", "world_sizes": [2], "strategies": ["ddp"], **arguments}
    model = options.pop("model")
    with pytest.raises(ConfigError, match=match):
        ddplab.plan(model, **options)


@pytest.mark.parametrize("value, match", [
    (0, r"efficiency is .* a number in \(0, 1\] such as 0.4; got 0"),
    (-0.4, r"got -0.4"),
    (float("nan"), r"got nan"),
    (float("inf"), r"got inf"),
    (True, r"got True"),
    ("0.4", r"got '0.4'"),
    (40, r"efficiency=40 is more than the device's peak: .* not a percentage. Did you mean 0.40\?"),
    (1.5, r"efficiency=1.5 is more than the device's peak: .* Did you mean 0.01\?"),
    (400, r"efficiency=400 is more than the device's peak: it is a share in \(0, 1\], not a percentage.$"),
])
def test_efficiency_is_a_share_of_the_peak(nothing_traced, value, match):
    refused(match, efficiency=value)


@pytest.mark.parametrize("value, match", [
    (["8"], r"world_sizes holds '8' \(str\); each is a whole number of ranks.*write 8 without quotes"),
    (8, r"world_sizes is a list of rank counts such as \[8, 64, 1024\]; got 8: write \[8\]"),
    ("8", r"world_sizes is a list of rank counts .* got '8'"),
    ([], r"world_sizes is empty: give at least one rank count"),
    ([0], r"world_sizes holds 0; a world has 1 rank or more"),
    ([-1], r"world_sizes holds -1; a world has 1 rank or more"),
    ([True], r"world_sizes holds True \(bool\)"),
    ([8.0], r"world_sizes holds 8.0 \(float\)"),
    ([8, 64, 8], r"world_sizes gives 8 twice"),
])
def test_world_sizes_are_positive_whole_numbers(nothing_traced, value, match):
    refused(match, world_sizes=value)


@pytest.mark.parametrize("value, match", [
    ("ddp", r"strategies is a list of strategies; got the single 'ddp': write \['ddp'\]"),
    (["tp2+tp2+fsdp"], r"cannot read the strategy 'tp2\+tp2\+fsdp' \(the part 'tp2': given twice\)"),
    (["fsdp+ddp"], r"the part 'ddp': a second data strategy after 'fsdp'"),
    (["tp0+fsdp"], r"the part 'tp0': sizes are 1 or more"),
    (["zero3"], r"the part 'zero3': not a strategy\).*e.g. 'fsdp'"),
    (["tp2v2+fsdp"], r"only pp has stages per rank"),
    (["fsdp", "fsdp"], r"strategies names fsdp twice"),
    (["tp8+fsdp", "fsdp+tp8"], r"strategies names tp8\+fsdp twice \(the parts in another order"),
    ([], r"strategies is empty"),
    ([8], r"a strategy is a string such as 'fsdp'.*got 8 \(int\)"),
])
def test_strategies_are_read_strictly(nothing_traced, value, match):
    refused(match, strategies=value)


@pytest.mark.parametrize("network, match", [
    ({"alpha": 1e-5}, r"network dict has no 'beta': it needs 'alpha' \(seconds per message\) and 'beta'"),
    ({"beta": 1e-9}, r"network dict has no 'alpha'"),
    ({"alpha": float("nan"), "beta": 1e-9}, r"alpha must be a finite number >= 0 .* got nan"),
    ({"alpha": 1e-5, "beta": float("inf")}, r"beta must be a finite number >= 0 .* got inf"),
    ({"alpha": -1e-5, "beta": 1e-9}, r"alpha must be a finite number >= 0"),
    ({"alpha": 1e-5, "beta": -1e-9}, r"beta must be a finite number >= 0"),
    ("carrier pigeon", r"no interconnect named 'carrier pigeon'"),
    (42, r"network is a name, a Network or a dict with 'alpha' and 'beta'"),
])
def test_networks_need_a_finite_alpha_and_beta(nothing_traced, network, match):
    refused(match, network=network)


@pytest.mark.parametrize("model, match", [
    ({"layers": 2, "dtype": "float32"}, r"unknown model config key 'dtype' \(the dtypes are now one recipe: "
                                        r"precision='bf16-mixed'.*\); a config has name, kind, layers"),
    ({"layers": 2, "widht": 8}, r"unknown model config key 'widht'"),
    ({"layers": 0}, r"layers must be a positive int, got 0"),
    ({"kind": "rnn"}, r"kind must be one of gpt, llama, mlp, got 'rnn'"),
    ({"precision": "fp8"}, r"precision must be one of fp32, bf16, bf16-mixed, got 'fp8'"),
    ({"d_model": 100, "head_dim": 64}, r"d_model=100 does not split into heads of head_dim=64"),
    ({"kind": "llama", "d_model": 256, "head_dim": 64, "kv_heads": 3},
     r"4 query heads do not share kv_heads=3"),
    ({"batch": 6, "microbatch": 4}, r"batch=6 does not split into micro-batches of 4"),
])
def test_model_configs_name_the_bad_key(nothing_traced, model, match):
    refused(match, model=model)


def test_config_but_names_an_unknown_field():
    with pytest.raises(ConfigError, match="unknown model config key 'seq_len'"):
        Config().but(seq_len=4)


@pytest.mark.parametrize("value", [0, -1, float("nan"), "60"])
def test_timeout_is_a_positive_number(nothing_traced, value):
    refused(r"timeout is the seconds the tracing may take, a number > 0", timeout=value)


@pytest.mark.parametrize("device, match", [
    ("tpu9", r"no device named 'tpu9'"),
    (42, r"device is a name \(h100, .*\) or a Device \(from ddplab.plan import Device\)")])
def test_devices_are_named_or_made(nothing_traced, device, match):
    refused(match, device=device)


def test_context_parallelism_gets_a_row_that_says_why(nothing_traced):
    """torch's context_parallel cannot trace on a CPU: the row says so, nothing is traced."""
    made = ddplab.plan("toy", [4], ["cp2+fsdp"])
    assert made.row("cp2+fsdp", 4).error.startswith("torch 2.13's context_parallel swaps in ring attention "
                                                    "only for the GPU attention ops")
    assert "cannot: torch 2.13's context_parallel" in made.table()


def test_parse_reads_interleaving_and_refuses_nonsense():
    s = parse("pp8v2+tp8+fsdp")
    assert (s.data, s.tp, s.pp, s.virtual, s.name) == ("fsdp", 8, 8, 2, "tp8+pp8v2+fsdp")
    assert parse("fsdp+tp2") == parse("tp2+fsdp") and parse("ZeRO2").data == "zero2"
    with pytest.raises(ConfigError, match="not a strategy"):
        parse("pp2x2+fsdp")


@pytest.mark.slow
def test_a_plan_that_runs_out_of_time_names_its_timeout():
    started = time.monotonic()
    with pytest.raises(DdplabError, match=r"(?s)did not finish within timeout=0.5 s.*"
                                          r"ddplab.plan\(\.\.\., timeout=\.\.\.\)"):
        ddplab.plan("llm-8b", [8], ["fsdp"], timeout=0.5)
    assert time.monotonic() - started < 60          # ended at its timeout, not after the tracing


@pytest.mark.parametrize("path", ["/nonexistent-folder/plan.png", "/proc/plan.png", "/tmp"])
def test_the_command_line_checks_the_plot_path_before_the_work(path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ddplab.plan", "llm-8b", "--world-sizes", "8",
                           "--plot", path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot save to" in done.stderr or "is a folder" in done.stderr
    assert "planned in" not in done.stdout
    assert time.monotonic() - started < 60          # an import, no tracing


def test_the_command_line_refuses_a_percentage_efficiency():
    done = subprocess.run([sys.executable, "-m", "ddplab.plan", "toy", "--efficiency", "40"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Did you mean 0.40?" in done.stderr
