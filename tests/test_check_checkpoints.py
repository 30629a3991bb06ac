"""Checkers of notebook 10 (checkpoints and failures): each accepts the right answer and names each mistake.

The student's code runs on the ranks of a real 2-rank gloo lab, defined by a
%%ranks-like cell (``lab.run_cell``) as the notebook's exercise cells define it.
"""

from __future__ import annotations

import pytest
from conftest import fails, last_line

import ddplab

pytestmark = pytest.mark.slow

IMPORTS = """
import os
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
"""


# ------------------------------------------------------------- save_sharded
SAVE = IMPORTS + """
def save_sharded(path, model, optimizer, epoch):
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "epoch": epoch}, checkpoint_id=path)
"""


def test_save_sharded_accepts_dcp_with_get_state_dict(fresh_lab, capsys):
    fresh_lab.run_cell(SAVE)
    ddplab.check.save_sharded()
    assert last_line(capsys).startswith("Correct: every rank wrote its own shard")


@pytest.mark.parametrize("edit,needle", [
    (('"optim": optim_state, ', ""), "no optimizer state"),
    (('"optim": optim_state', '"optim": optimizer.state_dict()'), "keyed by parameter number"),
    (('"epoch": epoch}', '"epoch": epoch, "grads": [p.grad for p in model.parameters()]}'),
     "save only what must be saved"),
    (('dcp.save({"model": model_state, "optim": optim_state, "epoch": epoch}, checkpoint_id=path)',
      'os.makedirs(path, exist_ok=True); torch.save(model_state, os.path.join(path, "m.pt")) '
      'if dist.get_rank() == 0 else None'), "torch.distributed.checkpoint's, saved by every rank"),
])
def test_save_sharded_rejects(fresh_lab, edit, needle):
    source = SAVE.replace(*edit)
    assert source != SAVE
    fresh_lab.run_cell(source)
    fails(ddplab.check.save_sharded, needle)


# ------------------------------------------------------------- load_resharded
LOAD = IMPORTS + """
def load_resharded(path, model, optimizer):
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "epoch": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["epoch"]
"""


def test_load_resharded_accepts_load_into_the_models_own_layout(fresh_lab, capsys):
    fresh_lab.run_cell(LOAD)
    ddplab.check.load_resharded()
    assert last_line(capsys).startswith("Correct: a checkpoint saved from FSDP2 shards loads")


@pytest.mark.parametrize("edit,needle", [
    (('"optim": optim_state, "epoch": 0}', '"epoch": 0}'), "load the optimizer state too"),
    (('return state["epoch"]', "return 0"), "the epoch load_resharded returned"),
    (('dcp.load(state, checkpoint_id=path)', 'pass'),
     "a FSDP2 model holds the saved weights after load_resharded: not so"),
])
def test_load_resharded_rejects(fresh_lab, edit, needle):
    source = LOAD.replace(*edit)
    if '"optim": optim_state' not in source:          # the model only: set it alone
        source = source.replace('set_state_dict(model, optimizer, model_state_dict=state["model"], '
                                'optim_state_dict=state["optim"])',
                                'set_model_state_dict(model, state["model"])')
    assert source != LOAD
    fresh_lab.run_cell(source)
    fails(ddplab.check.load_resharded, needle)


# ------------------------------------------------------------- resumable_train
TRAIN = IMPORTS + """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from ddplab import data, sharding

def make_run():
    train_set, _ = data.digits(dtype=torch.float64)
    sampler = DistributedSampler(Subset(train_set, range(96)), shuffle=True, seed=0)
    loader = DataLoader(Subset(train_set, range(96)), batch_size=16, sampler=sampler)
    model = DDP(sharding.mlp(seed=0, dtype=torch.float64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), sampler, loader

def latest(path):
    done = [int(name[5:]) for name in os.listdir(path) if name.startswith("epoch")
            and os.path.exists(os.path.join(path, name, ".metadata"))] if os.path.isdir(path) else []
    return os.path.join(path, f"epoch{max(done)}") if done else None

def train(path, epochs, stop_after=None):
    model, optimizer, sampler, loader = make_run()
    start = 0
    if latest(path):
        start = load_state(latest(path), model, optimizer)
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        save_state(os.path.join(path, f"epoch{epoch + 1}"), model, optimizer, epoch + 1)
        if stop_after is not None and epoch + 1 == stop_after:
            break
    return sharding.full_weights(model)
"""


def test_resumable_train_accepts_a_loop_that_restores_the_epoch(fresh_lab, capsys):
    fresh_lab.run_cell(TRAIN + "save_state = load_state = None   # the check brings its own")
    ddplab.check.resumable_train()
    assert last_line(capsys).startswith("Correct: stopped after epoch 1 and resumed")
    fresh_lab.run_cell("assert save_state is None and load_state is None")   # given back


def test_resumable_train_rejects_a_run_that_starts_over(fresh_lab):
    """The bypass: never load, train every epoch again (the weights end the same)."""
    source = TRAIN.replace("        start = load_state(latest(path), model, optimizer)", "        pass")
    assert source != TRAIN
    fresh_lab.run_cell(source)
    fails(ddplab.check.resumable_train, "what the resumed run loaded and saved", "starts over")


@pytest.mark.parametrize("edit,needle", [
    (("sampler.set_epoch(epoch)", "sampler.set_epoch(epoch - start)"), "give the sampler the true epoch"),
    (("        start = load_state(", "        load_state("), "is wrong"),
    (("        if stop_after is not None and epoch + 1 == stop_after:\n            break\n", ""),
     "return right after saving"),
    (('f"epoch{epoch + 1}"', '"last"'), "save one checkpoint per epoch"),
])
def test_resumable_train_rejects(fresh_lab, edit, needle):
    source = TRAIN.replace(*edit)
    assert source != TRAIN
    fresh_lab.run_cell(source)
    fails(ddplab.check.resumable_train, needle)


# ------------------------------------------------------------ async_checkpoint
ASYNC = IMPORTS + """
def async_checkpoint(path, model, optimizer, epoch):
    model_state, optim_state = get_state_dict(model, optimizer)
    return dcp.async_save({"model": model_state, "optim": optim_state, "epoch": epoch},
                          checkpoint_id=path)
"""


def test_async_checkpoint_accepts_async_save(fresh_lab, capsys):
    fresh_lab.run_cell(ASYNC)
    ddplab.check.async_checkpoint()
    assert last_line(capsys).startswith("Correct: async_checkpoint returns at once with a future")


def test_async_checkpoint_rejects_a_blocking_save_returned_as_a_finished_future(fresh_lab):
    """The bypass: dcp.save in the call, then a Future already done (it "returns a Future")."""
    fresh_lab.run_cell(IMPORTS + """
from concurrent.futures import Future

def async_checkpoint(path, model, optimizer, epoch):
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "epoch": epoch}, checkpoint_id=path)
    done = Future()
    done.set_result(None)
    return done
""")
    fails(ddplab.check.async_checkpoint, "written in a background thread",
          "let torch's asynchronous save write")


def test_async_checkpoint_rejects_a_blocking_save(fresh_lab):
    fresh_lab.run_cell(ASYNC.replace("return dcp.async_save", "dcp.save"))
    # Issue 58: it said "returned a concurrent.futures.Future is wrong" of a function that returned None.
    message = fails(ddplab.check.async_checkpoint)
    assert message.startswith("async_checkpoint returned None on ranks 0, 1, not a "
                              "concurrent.futures.Future."), message
    assert "  rank 0: expected a concurrent.futures.Future\n          got      None   <-- wrong" in message
    assert "returned a concurrent.futures.Future is wrong" not in message


# ------------------------------------------------------------------ train_state
STATE = IMPORTS + """
from torch.distributed.checkpoint.stateful import Stateful

class TrainState(Stateful):
    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.epoch, self.step = 0, 0

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                "epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.step = state["epoch"], state["step"]
"""


def test_train_state_accepts_a_stateful_of_every_part(fresh_lab, capsys):
    fresh_lab.run_cell(STATE)
    ddplab.check.train_state()
    assert last_line(capsys).startswith("Correct: TrainState goes through DCP whole")


@pytest.mark.parametrize("edit,needle", [
    # the bypass: load nothing, so the run trains again from the start
    (('        self.epoch, self.step = state["epoch"], state["step"]\n', "        pass\n"),
     "does not resume"),
    (('"scheduler": self.scheduler.state_dict(),', ""), "the LR scheduler's state is missing"),
    (('        self.scheduler.load_state_dict(state["scheduler"])\n', ""),
     "every step after dcp.load"),
    # pickled by hand beside the checkpoint, DCP given the position only
    (('        model_state, optim_state = get_state_dict(self.model, self.optimizer)\n'
      '        return {"model": model_state, "optim": optim_state, "scheduler": '
      'self.scheduler.state_dict(),\n',
      '        torch.save(self.model.state_dict(), os.path.join(os.environ["TMPDIR"], '
      'f"side{dist.get_rank()}.pt"))\n        return {'), "let DCP write them"),
])
def test_train_state_rejects(fresh_lab, edit, needle):
    source = STATE.replace(*edit)
    assert source != STATE
    fresh_lab.run_cell(source)
    fails(ddplab.check.train_state, needle)


# ------------------------------------------------------------- torchrun_resume
RESUME = IMPORTS + """
def resume(folder, model, optimizer):
    done = [int(name[5:]) for name in os.listdir(folder)
            if name.startswith("epoch") and os.path.exists(os.path.join(folder, name, ".metadata"))]
    if not done:
        return 0
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "epoch": 0}
    dcp.load(state, checkpoint_id=os.path.join(folder, f"epoch{max(done)}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["epoch"]
"""


def test_torchrun_resume_accepts_the_newest_complete_checkpoint(fresh_lab, capsys):
    fresh_lab.run_cell(RESUME)
    ddplab.check.torchrun_resume()
    assert last_line(capsys).startswith("Correct: killed and restarted by torchrun, the job resumed")


@pytest.mark.parametrize("edit,needle", [
    # the bypass: every attempt starts over (the weights end the same)
    (("    if not done:\n", "    if True:\n"), "started over at epoch 0"),
    # the newest folder, complete or not: the save that died
    ((' and os.path.exists(os.path.join(folder, name, ".metadata"))', ""), "a save that died"),
])
def test_torchrun_resume_rejects(fresh_lab, edit, needle):
    source = RESUME.replace(*edit)
    assert source != RESUME
    fresh_lab.run_cell(source)
    fails(ddplab.check.torchrun_resume, needle)


@pytest.mark.parametrize("source,check", [
    # notebook 10 imports the references on the ranks for its resumable run: an alias is the answer
    ("from ddplab.check.nb10_checkpoints_and_failures import reference_save as save_state\n"
     "def save_sharded(path, model, optimizer, epoch):\n    save_state(path, model, optimizer, epoch)\n",
     "save_sharded"),
    ("from ddplab.check.nb10_checkpoints_and_failures import reference_load\n"
     "load_resharded = reference_load\n",
     "load_resharded"),
])
def test_the_checks_own_references_are_refused_under_any_name(fresh_lab, source, check):
    fresh_lab.run_cell(IMPORTS + source)
    fails(getattr(ddplab.check, check),
          f"{check} builds a ", "so it may not use ddplab's checkpoint references")
