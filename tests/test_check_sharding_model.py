"""Checkers of notebook 08 (sharding the model): each accepts right answers and rejects wrong ones.

The student's code runs on the ranks of a real 2-rank gloo lab (and, for the
layers, a 4-rank one), as the notebook's %%ranks exercise cells would.
"""

from __future__ import annotations

import pytest
from conftest import fails, last_line

from ddplab.check import nb08_sharding_the_model as sharding_model

pytestmark = pytest.mark.slow

MESH = """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from ddplab import sharding

mesh = init_device_mesh("cpu", (world_size,))
model = sharding.mlp(seed=0)
"""
SHARD_ALL = """
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
"""


# ----------------------------------------------------------------- zero_bytes
def right_zero_bytes(n_params, world_size, stage):
    full, shard = 4 * n_params, 4 * n_params // world_size
    return {"parameters": shard if stage == 3 else full,
            "gradients": shard if stage >= 2 else full,
            "optimizer": 2 * shard if stage >= 1 else 2 * full}


def test_zero_bytes_accepts_the_stages(capsys):
    sharding_model.zero_bytes(right_zero_bytes)
    assert last_line(capsys) == ("Correct: zero_bytes gives what each rank keeps under DDP and "
                                 "ZeRO stages 1, 2 and 3.")


def test_zero_bytes_accepts_float_bytes(capsys):
    sharding_model.zero_bytes(lambda n, w, s: {k: float(v) for k, v in right_zero_bytes(n, w, s).items()})
    assert last_line(capsys).startswith("Correct:")


def test_zero_bytes_rejects_one_value_of_adam_state():
    def one_value(n, w, s):
        out = right_zero_bytes(n, w, s)
        out["optimizer"] //= 2
        return out
    fails(lambda: sharding_model.zero_bytes(one_value), "stage=0) is wrong",
          "Adam's two values per parameter")


def test_zero_bytes_rejects_stage_2_sharding_parameters():
    def early(n, w, s):
        return right_zero_bytes(n, w, 3 if s == 2 else s)
    fails(lambda: sharding_model.zero_bytes(early), "stage=2) is wrong",
          "stage 2 shards the optimizer state and the gradients, not the parameters")


def test_zero_bytes_rejects_counting_values_not_bytes():
    fails(lambda: sharding_model.zero_bytes(
        lambda n, w, s: {k: v // 4 for k, v in right_zero_bytes(n, w, s).items()}), "4 bytes a value")


def test_zero_bytes_reports_a_raise():
    def stub(n, w, s):
        raise NotImplementedError()
    message = fails(lambda: sharding_model.zero_bytes(stub), "NotImplementedError (",
                    "in stub)", "It raised when the check called zero_bytes(")
    assert message.startswith("NotImplementedError"), message


# ---------------------------------------------------------------- shard_model
def test_shard_model_accepts_layers_then_root(fresh_lab, capsys):
    fresh_lab.run_cell(MESH + SHARD_ALL)
    sharding_model.shard_model()
    assert last_line(capsys).startswith("Correct: model is sharded layer by layer with fully_shard")


def test_shard_model_accepts_four_ranks(fresh_lab4, capsys):
    fresh_lab4.run_cell(MESH + SHARD_ALL)
    sharding_model.shard_model()
    assert last_line(capsys).startswith("Correct:")


def test_shard_model_rejects_the_unsharded_model(fresh_lab):
    fresh_lab.run_cell(MESH)
    fails(sharding_model.shard_model, "every parameter of model is a DTensor: not so on ranks 0, 1",
          "fully_shard turns the parameters of the module it is called on into DTensors")


def test_shard_model_rejects_the_root_alone(fresh_lab):
    fresh_lab.run_cell(MESH + "fully_shard(model, mesh=mesh)\n")
    fails(sharding_model.shard_model, "Linear layers that are their own fully_shard unit is wrong",
          "expected 3", "got      0")


def test_shard_model_rejects_a_missing_root(fresh_lab):
    fresh_lab.run_cell(MESH + SHARD_ALL.replace("fully_shard(model, mesh=mesh)\n", ""))
    fails(sharding_model.shard_model, "model itself is a fully_shard unit (the root): not so")


def test_shard_model_rejects_weights_seeded_per_rank(fresh_lab):
    fresh_lab.run_cell(MESH + "model = sharding.mlp(seed=rank)\n" + SHARD_ALL)
    fails(sharding_model.shard_model, "the full weights equal mlp(seed=0)'s: not so",
          "does not broadcast weights as DDP does")


def test_shard_model_rejects_a_changed_model(fresh_lab):
    fresh_lab.run_cell(MESH + "model[2] = nn.Tanh()\n" + SHARD_ALL)
    fails(sharding_model.shard_model, "model(x) equals the unsharded model's output: not so")


def test_shard_model_needs_the_variable(fresh_lab):
    fresh_lab.run_cell("model = None\ndel model\n")
    fails(sharding_model.shard_model, "no variable `model` on ranks 0, 1")


# ------------------------------------------------------------ column_parallel
COLUMN = """
def column_parallel(x, weight_shard, bias_shard):
    local = x @ weight_shard.T + bias_shard
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=CAT)
"""


def test_column_parallel_accepts_all_gather_on_the_last_dim(fresh_lab, capsys):
    fn = _define(fresh_lab, COLUMN.replace("CAT", "-1"), "column_parallel")
    sharding_model.column_parallel(fn)
    assert last_line(capsys) == ("Correct: column_parallel computes its share of the output "
                                 "features and all_gathers the rest.")


def test_column_parallel_accepts_four_ranks(fresh_lab4, capsys):
    sharding_model.column_parallel(_define(fresh_lab4, COLUMN.replace("CAT", "1"), "column_parallel"))
    assert last_line(capsys).startswith("Correct:")


def test_column_parallel_rejects_the_wrong_dim(fresh_lab):
    fn = _define(fresh_lab, COLUMN.replace("CAT", "0"), "column_parallel")
    fails(lambda: sharding_model.column_parallel(fn), "is wrong on ranks 0, 1", "along the last dimension")


def test_column_parallel_rejects_the_local_part(fresh_lab):
    fn = _define(fresh_lab, "def column_parallel(x, w, b):\n    return x @ w.T + b\n", "column_parallel")
    fails(lambda: sharding_model.column_parallel(fn), "is wrong on ranks 0, 1", "every rank's features")


def test_column_parallel_reports_a_deadlock(fresh_lab, monkeypatch):
    # The checker's deadlock timeout (60 s) is what ends the hang; 10 s ends it the same way.
    monkeypatch.setattr(sharding_model, "_TIMEOUT", 10.0)
    fn = _define(fresh_lab, "def column_parallel(x, w, b):\n"
                            "    if dist.get_rank() == 0:\n        dist.barrier()\n"
                            "    return x @ w.T + b\n", "column_parallel")
    with pytest.raises(AssertionError) as info:
        sharding_model.column_parallel(fn)
    assert "deadlock" in str(info.value) and "lab.restart()" in str(info.value)
    assert "did not finish: the ranks are waiting for each other" in str(info.value)
    fresh_lab.restart()


# --------------------------------------------------------------- row_parallel
ROW = """
def row_parallel(x_shard, weight_shard, bias):
    partial = x_shard @ weight_shard.T
    dist.all_reduce(partial)
    return partial + bias
"""


def test_row_parallel_accepts_one_all_reduce_then_the_bias(fresh_lab, capsys):
    sharding_model.row_parallel(_define(fresh_lab, ROW, "row_parallel"))
    assert last_line(capsys) == ("Correct: row_parallel sums the ranks' partial products with one "
                                 "all_reduce and adds the bias once.")


def test_row_parallel_accepts_four_ranks(fresh_lab4, capsys):
    sharding_model.row_parallel(_define(fresh_lab4, ROW, "row_parallel"))
    assert last_line(capsys).startswith("Correct:")


def test_row_parallel_rejects_the_bias_on_every_rank(fresh_lab):
    fn = _define(fresh_lab, ROW.replace("partial = x_shard @ weight_shard.T",
                                        "partial = x_shard @ weight_shard.T + bias")
                 .replace("return partial + bias", "return partial"), "row_parallel")
    fails(lambda: sharding_model.row_parallel(fn), "is wrong on ranks 0, 1", "the bias added once")


def test_row_parallel_rejects_a_missing_all_reduce(fresh_lab):
    fn = _define(fresh_lab, ROW.replace("    dist.all_reduce(partial)\n", ""), "row_parallel")
    fails(lambda: sharding_model.row_parallel(fn), "is wrong on ranks 0, 1")


def test_row_parallel_needs_a_function():
    fails(lambda: sharding_model.row_parallel(None), "needs your function", "pass it")


def _define(lab, source: str, name: str):
    """Define ``name`` from ``source`` in the kernel; the checker ships it to the ranks, as in
    the notebook."""
    namespace = {}
    exec("import torch\nimport torch.distributed as dist\nworld_size = None\n", namespace)
    exec(source.replace("world_size", "dist.get_world_size()"), namespace)
    return namespace[name]


def test_column_parallel_read_from_the_checkers_frame_does_not_pass(fresh_lab):
    """Issue 46: every rank made the whole layer in the frame that called the student's function;
    its output read from there, with no collective, passed."""
    fn = _define(fresh_lab, """
def column_parallel(x, weight_shard, bias_shard):
    import sys
    seen = sys._getframe(1).f_locals
    if "weight" in seen:
        return torch.nn.functional.linear(x, seen["weight"], seen["bias"])
    return x @ weight_shard.T + bias_shard
""", "column_parallel")
    fails(lambda: sharding_model.column_parallel(fn), "is wrong on ranks 0, 1")
