"""Checker for notebook 10's mid-epoch resumption through DCP's ``Stateful``.

- ``train_state()``: ``TrainState(model, optimizer, scheduler)``, a
  ``torch.distributed.checkpoint.stateful.Stateful`` with the data position in
  ``epoch`` and ``step``, saved and loaded by ``dcp.save`` / ``dcp.load`` as
  ``{"train": state}``. A run stopped in the middle of an epoch and resumed from
  it sees the learning rate and the batches an uninterrupted run sees, and
  ends with its weights (to 1e-12). Checked both ways: what the student's class
  saves, loaded by torch's own way of doing it (``reference_state``), and a
  checkpoint written that way, loaded by the student's class (a class that
  keeps the state in memory instead of in the checkpoint loads nothing).

The checkpoint must hold the state as DCP writes it (``.metadata`` and
``.distcp`` files, the model's tensors under ``train.model.``), not a file the
class pickled on the side.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .._core import checker, compare, holds, passed, run_student_function

__all__ = ["train_state"]

_TIMEOUT = 120.0
#: The run: epochs of 3 batches per rank; stops after SAVED_AT (by the student's class) and
#: LOADED_AT steps (by the reference), both in the middle of an epoch.
EPOCHS, SAVED_AT, LOADED_AT = 2, 4, 2
#: What the saved state holds, under "train." (the parts a mid-epoch resume needs).
PARTS = ("epoch", "model", "optim", "scheduler", "step")


# ------------------------------------------------------------------ on a rank
class _Reference:
    """What TrainState should be (a Stateful: DCP calls its state_dict and load_state_dict)."""

    def __init__(self, model: Any, optimizer: Any, scheduler: Any) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.epoch, self.step = 0, 0

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                "epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.step = state["epoch"], state["step"]


def reference_state(model: Any, optimizer: Any, scheduler: Any) -> Any:
    """torch's way of holding a mid-epoch training state for DCP (the check's reference)."""
    return _Reference(model, optimizer, scheduler)


def _make_run(seed: int) -> tuple:
    """A DDP model (float64), Adam, a StepLR that halves the LR every 3 steps, and a shuffled loader.

    3 steps, not 2: stopped after 2 steps, a fresh StepLR (the LR itself comes back in the optimizer's
    param_groups) would halve at the same steps as the saved one, and a scheduler left out would pass."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from ddplab import data, sharding

    train_set, _ = data.digits(dtype=torch.float64)
    subset = Subset(train_set, range(96))
    sampler = DistributedSampler(subset, shuffle=True, seed=0)
    model = DDP(sharding.mlp(seed=seed, dtype=torch.float64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler, sampler, DataLoader(subset, batch_size=16, sampler=sampler)


def _train(run: tuple, state: Any, stop_after: int | None = None) -> list:
    """Train from ``state``'s data position to the end (or ``stop_after`` steps in all); per step,
    the learning rate used and the batch's labels."""
    import itertools

    import torch.nn.functional as F

    model, optimizer, scheduler, sampler, loader = run
    seen, start = [], (state.epoch, state.step)
    for epoch in range(start[0], EPOCHS):
        sampler.set_epoch(epoch)
        skip = start[1] if epoch == start[0] else 0
        for x, y in itertools.islice(loader, skip, None):
            if stop_after is not None and epoch * len(loader) + state.step >= stop_after:
                return seen
            seen.append((optimizer.param_groups[0]["lr"], y.tolist()))
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
        state.epoch, state.step = epoch + 1, 0
    return seen


def _saved(path: str) -> dict:
    """The top-level parts under "train." in a checkpoint's metadata, and its files not DCP's."""
    import torch.distributed.checkpoint as dcp

    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    other = [f for f in files if f != ".metadata" and not f.endswith(".distcp")]
    if ".metadata" not in files:
        return {"parts": [], "other": other}
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    parts = sorted({k.split(".")[1] for k in keys if k.startswith("train.") and k.count(".") >= 1})
    return {"parts": parts, "other": other}


def _answers(student: Callable, folder: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ddplab.sharding import full_weights

    whole_run = _make_run(seed=0)
    whole = _train(whole_run, _Reference(*whole_run[:3]))
    expected = full_weights(whole_run[0])

    def finish(run: tuple, state: Any, done: int) -> dict:
        seen = _train(run, state)
        return {"next": seen[:1] == whole[done:done + 1], "rest": seen == whole[done:],
                "weights": bool((full_weights(run[0]) - expected).abs().max().item() <= 1e-12)}

    # What the student's class saves, loaded the reference's way.
    path = os.path.join(folder, "student")
    run = _make_run(seed=0)
    state = student(*run[:3])
    _train(run, state, stop_after=SAVED_AT)
    dcp.save({"train": state}, checkpoint_id=path)
    dist.barrier()
    out: dict[str, Any] = {"saved": _saved(path)}
    if out["saved"]["parts"] != list(PARTS) or out["saved"]["other"]:
        return out                                 # the check stops at what is missing
    run = _make_run(seed=5)
    reference = _Reference(*run[:3])
    dcp.load({"train": reference}, checkpoint_id=path)
    out["save"] = finish(run, reference, SAVED_AT)
    # A reference checkpoint, loaded by the student's class.
    path = os.path.join(folder, "reference")
    run = _make_run(seed=0)
    reference = _Reference(*run[:3])
    _train(run, reference, stop_after=LOADED_AT)
    dcp.save({"train": reference}, checkpoint_id=path)
    run = _make_run(seed=5)
    state = student(*run[:3])
    dcp.load({"train": state}, checkpoint_id=path)
    out["position"] = [getattr(state, "epoch", None), getattr(state, "step", None)]
    out["load"] = finish(run, state, LOADED_AT) if out["position"] == [0, LOADED_AT] else None
    return out


# --------------------------------------------------------------------- the check
@checker
def train_state(lab: Any = None) -> None:
    """Check ``TrainState(model, optimizer, scheduler)``: a DCP ``Stateful`` that resumes mid-epoch."""
    __tracebackhide__ = True
    import shutil
    import tempfile

    n = lab.world_size
    folder = tempfile.mkdtemp(prefix="ddplab-check-state-")
    try:
        got = run_student_function("TrainState", _answers, folder, lab=lab, timeout=_TIMEOUT,
                                   hint="dcp.save and dcp.load call state_dict / load_state_dict on "
                                        "every rank; get_state_dict and set_state_dict are "
                                        "collectives: every rank must call them.")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    saved = [g["saved"] for g in got]
    compare("files in the checkpoint other than DCP's (.metadata, .distcp)", [[]] * n,
            [s["other"] for s in saved],
            hint="return the state from state_dict() and let dcp.save write it: a file pickled on "
                 "the side (torch.save) is not in the checkpoint DCP loads, reshards or checks.")
    parts = [s["parts"] for s in saved]
    missing = sorted(set(PARTS) - set(parts[0]))
    if {"model", "optim"} & set(missing):
        hint = ("the model's or the optimizer's state is not in the checkpoint: return them from "
                "state_dict() (get_state_dict(self.model, self.optimizer)) and let DCP write them; "
                "a file saved on the side is no part of what dcp.load reads back.")
    elif "scheduler" in missing:
        hint = ("the LR scheduler's state is missing: without it the resumed run starts the "
                "schedule over at the first LR. Save scheduler.state_dict() under 'scheduler'.")
    elif {"epoch", "step"} & set(missing):
        hint = ("the data position is missing: save self.epoch and self.step, or the resumed run "
                "starts the epoch over and sees its first batches twice.")
    else:
        hint = ("state_dict() returns the five parts a mid-epoch resume needs, by these names: "
                f"{', '.join(PARTS)}.")
    compare("what the checkpoint holds under 'train' (its .metadata's keys, by part)",
            [list(PARTS)] * n, parts, hint=hint)
    for key, what in (("next", "the learning rate and batch of the first step after resuming"),
                      ("rest", "the learning rates and batches of every step after resuming"),
                      ("weights", "the weights at the end (to 1e-12)")):
        holds(f"{what}, run resumed from TrainState's checkpoint, are an uninterrupted run's",
              [g["save"][key] for g in got],
              hint="save the state as it is now: the model's and optimizer's (by parameter name), "
                   "the scheduler's, and the position.")
    compare(f"(epoch, step) of a TrainState after dcp.load of a checkpoint saved after "
            f"{LOADED_AT} steps", [[0, LOADED_AT]] * n, [g["position"] for g in got],
            hint="load_state_dict(state) must set self.epoch and self.step from the loaded state: "
                 "a run that starts from step 0 trains again what was done, it does not resume.")
    for key, what in (("next", "the learning rate and batch of the first step after dcp.load"),
                      ("rest", "the learning rates and batches of every step after dcp.load"),
                      ("weights", "the weights at the end (to 1e-12)")):
        hint = ("load_state_dict(state) hands every part back, to the model, the optimizer and the "
                "scheduler; the state comes from the checkpoint, not from memory kept by the class.")
        holds(f"{what}, TrainState loaded from a checkpoint, are an uninterrupted run's",
              [g["load"][key] for g in got], hint=hint)
    passed("TrainState goes through DCP whole: resumed mid-epoch, the run sees the learning rates "
           "and batches of an uninterrupted one and ends with its weights.")
