"""Memory as torch holds it: mixed-precision recipes, activation checkpointing, pipelines, and the
shortcuts the tracer takes (3/4/5-block models, the optimizer on local shards) shown to change no byte."""

from __future__ import annotations

import pytest

from ddplab.plan import Config, memory, parallelize, parse, pipeline_schedule as schedule

LLAMA = Config("m", "llama", layers=8, d_model=256, head_dim=64, kv_heads=2, ffn=512, vocab=1000, seq=64,
               batch=2, precision="bf16-mixed", optimizer="adamw")
FREQS = LLAMA.seq * LLAMA.head_dim // 2 * 8          # the rotary buffer: complex64, counted as parameters


# ------------------------------------------------------------ torch's pipeline schedules
@pytest.mark.parametrize("pp, microbatches, rank, held",
                         [(4, 8, 0, 4), (4, 8, 3, 1), (4, 2, 0, 2), (8, 8, 7, 1)])
def test_1f1b_holds_min_p_minus_rank_micro_batches(pp, microbatches, rank, held):
    assert schedule.in_flight(pp, 1, microbatches, rank) == held


def test_interleaved_1f1b_reads_torchs_schedule():
    """ScheduleInterleaved1F1B's warmup on rank 0 of 4 with 2 stages each and 8 micro-batches:
    (V-1)·(M/rounds) + 2(P-1) = 4 + 6 = 10 stage-forwards, then one more before the first backward
    frees one: 11 stage-forwards of half the rank's layers, 5.5 of its whole."""
    assert schedule.in_flight(4, 2, 8, 0) == 11 / 2
    assert schedule.in_flight(4, 2, 8, 3) == (4 + 0 + 1) / 2
    assert schedule.bubble(4, 2, 8) == 3 / 16 and schedule.bubble(4, 1, 8) == 3 / 8


def test_layers_split_as_torchtitan_splits_them():
    """126 layers on 8 ranks: 15, then 16 six times, then 15; on 16 stages: 7, 8 x 14, 7."""
    assert [len(schedule.layers_of(126, 8, 1, r)) for r in range(8)] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert schedule.layers_of(126, 8, 2, 0) == [*range(0, 7), *range(63, 71)]
    assert len(schedule.layers_of(126, 8, 2, 7)) == 8 + 7


# ------------------------------------------------------------ traced (slow)
def state_per_parameter(config: Config, strategy: str, world_size: int) -> dict:
    got = memory.trace(config, parse(strategy), world_size)
    return {**{k: got["state"][k] / config.parameters for k in ("parameters", "gradients", "optimizer")},
            "model_states": got["model_states"] / config.parameters, "row": got}


@pytest.mark.slow
@pytest.mark.parametrize("precision, param, grad, optimizer", [
    ("fp32", 4, 4, 8), ("bf16", 2, 2, 4), ("bf16-mixed", 2, 2, 12)])   # bf16-mixed: the ZeRO paper's 2+2+12
def test_ddp_holds_the_recipes_bytes_per_parameter(precision, param, grad, optimizer):
    got = state_per_parameter(LLAMA.but(precision=precision), "ddp", 4)
    assert got["parameters"] == pytest.approx(param + FREQS / LLAMA.parameters, rel=1e-9)
    assert got["gradients"] == pytest.approx(grad, rel=1e-9)
    assert got["optimizer"] == pytest.approx(optimizer, rel=1e-3)       # and Adam's step counters
    assert "master weights" in got["row"]["source"] if precision == "bf16-mixed" else True


@pytest.mark.slow
def test_sharded_strategies_hold_what_the_zero_paper_says():
    n = 4
    zero1 = state_per_parameter(LLAMA, "zero1", n)        # master weights and moments: 12 bytes, sharded
    assert (zero1["parameters"], zero1["gradients"]) == pytest.approx((2 + FREQS / LLAMA.parameters, 2))
    assert zero1["optimizer"] == pytest.approx(12 / n, rel=0.25)      # whole parameters per rank
    fsdp = state_per_parameter(LLAMA, "fsdp", n)          # fp32 sharded weights are the master weights
    assert fsdp["parameters"] == pytest.approx(4 / n, rel=0.02)
    assert fsdp["gradients"] == pytest.approx(4 / n, rel=0.02)
    assert fsdp["optimizer"] == pytest.approx(8 / n, rel=0.02)
    zero2 = state_per_parameter(LLAMA, "zero2", n)        # the same state, and whole bf16 weights in between
    assert zero2["optimizer"] == pytest.approx(fsdp["optimizer"])
    assert zero2["model_states"] >= 2 + 12 / n and zero2["model_states"] > fsdp["model_states"]


@pytest.mark.slow
def test_checkpointing_keeps_less_and_full_keeps_each_blocks_input():
    per_block = {}
    for mode in ("none", "selective", "full"):
        rows = [memory.trace(LLAMA.but(layers=n, checkpointing=mode), parse("ddp"), 1) for n in (8, 9)]
        per_block[mode] = rows[1]["activations"] - rows[0]["activations"]
    assert per_block["none"] > per_block["selective"] > per_block["full"]
    assert per_block["full"] == LLAMA.batch * LLAMA.seq * LLAMA.d_model * 2    # its bf16 input, nothing else


@pytest.mark.slow
@pytest.mark.parametrize("strategy, world_size, layers", [
    ("ddp", 4, 14), ("fsdp", 8, 14), ("tp2+fsdp", 8, 14), ("pp2+zero2", 8, 28)])
def test_reading_a_line_through_3_4_and_5_blocks_changes_no_byte(monkeypatch, strategy, world_size, layers):
    config = LLAMA.but(layers=layers, checkpointing="selective")
    quick = memory.trace(config, parse(strategy), world_size)
    assert "traced with 3 and 4 blocks, checked with 5" in quick.pop("source")
    monkeypatch.setattr(memory, "SAMPLES", (10**6,) * 3)                # every block traced
    memory._local.cache_clear()                                          # ddp's, once per process
    whole = memory.trace(config, parse(strategy), world_size)
    memory._local.cache_clear()
    assert "traced whole" in whole.pop("source")
    assert quick == whole


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 64])
def test_zero1_from_ddps_forward_and_its_own_step_is_its_whole_trace(world_size):
    """zero1's forward and backward are ddp's with its optimizer state in place of ddp's; its
    step traced alone: the same numbers as one trace of everything."""
    config = LLAMA.but(layers=14, checkpointing="selective")
    strategy = parse("zero1")
    quick = memory.trace(config, strategy, world_size)
    whole = memory._finish(memory._measure(config, strategy, world_size, 0, None), config, strategy, 0,
                           "traced whole")
    assert "forward and backward as ddp's" in quick.pop("source") and whole.pop("source")
    assert quick == whole


class OnDTensors:
    """The optimizer on the DTensor parameters themselves (what OnShards avoids)."""

    def __init__(self, params, make):
        self.inner = make(params)

    def step(self):
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tp2+fsdp"])
def test_the_optimizer_on_local_shards_holds_what_it_holds_on_dtensors(monkeypatch, strategy):
    config = LLAMA
    quick = memory.trace(config, parse(strategy), 4)
    monkeypatch.setattr(parallelize, "OnShards", OnDTensors)
    slow = memory.trace(config, parse(strategy), 4)
    assert quick == slow


@pytest.mark.slow
def test_a_pipeline_row_is_its_fuller_end():
    row = memory.trace(LLAMA.but(batch=4), parse("pp2+fsdp"), 4)
    assert row["peak"] == max(row["peaks"]) and len(row["peaks"]) == 2
    assert row["pipeline_rank"] == row["peaks"].index(row["peak"])
    assert "2 micro-batches in flight" in row["source"] or "1 micro-batches in flight" in row["source"]
