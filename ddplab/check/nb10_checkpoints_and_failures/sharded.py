"""Checkers for notebook 10, checkpoints and failures.

- ``save_sharded()``: ``save_sharded(path, model, optimizer, epoch)``
  writes a ``torch.distributed.checkpoint`` of an FSDP2 model: every rank
  writes its own shard, and the checkpoint holds exactly ``model``, ``optim``
  (keyed by parameter name, as ``get_state_dict`` gives them) and ``epoch``:
  no gradients, nothing else.
- ``load_resharded()``: ``load_resharded(path, model, optimizer)`` loads a
  checkpoint saved from an FSDP2 model into a model of another layout (FSDP2
  and DDP), weights and Adam's state, and returns the saved epoch.
- ``resumable_train()``: ``train(path, epochs, stop_after=None)`` stopped after
  an epoch and run again ends with the weights of an uninterrupted run.
- ``async_checkpoint()``: ``async_checkpoint(path, model, optimizer, epoch)``
  returns the future of ``dcp.async_save`` at once; what it saves is the state
  at the call, even if training changes the weights before the write ends.

Every check builds its own models and folders on the ranks and compares with
torch's own save and load, never with stored numbers. That save and load,
``reference_save`` and ``reference_load`` below, are what ``save_sharded`` and
``load_resharded`` ask for, and notebook 10 imports them on the ranks for its
resumable run (``from ddplab.check.nb10_checkpoints_and_failures import ...``):
during the student's call they refuse (``REFERENCES``). They stay with the
checkers: they are a solution, and an installation made solution-free keeps
solution text nowhere but in the checkers (``tests/test_wheel.py``). The checks'
statements say what must hold of the saved files and the loaded state; none
shows a value to copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable

from .._core import checker, compare, holds, passed, run_student_function
from .._feedback import Feedback, Row, ranks_phrase
from .._forbid import refusing_library

__all__ = ["async_checkpoint", "load_resharded", "resumable_train", "save_sharded"]

_TIMEOUT = 120.0
#: ``reference_save`` and ``reference_load``, refused during the student's call (by code, so
#: under any name: notebook 10 imports them on the ranks as save_state/load_state).
REFERENCES = "ddplab's checkpoint references"


def _student(name: str, lab: Any, fn: Callable, *args: Any) -> list[Any]:
    return run_student_function(name, fn, *args, lab=lab, timeout=_TIMEOUT,
                                hint="every rank must call dcp.save / dcp.load (they are "
                                     "collectives), in the same order.")


class _Folder:
    """A temporary folder the kernel makes and every rank writes into (same machine), removed after."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="ddplab-check-ckpt-")
        return self.path

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# ------------------------------------------------------------------ on a rank
def _fsdp(seed: int) -> tuple[Any, Any]:
    """On a rank: notebook 08's MLP under fully_shard (every Linear, then the root) and its Adam."""
    import torch

    from ddplab.checkpointing import fsdp_mlp

    model = fsdp_mlp(seed=seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _ddp(seed: int) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sharding import mlp

    model = DDP(mlp(seed=seed, dtype=torch.float64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def reference_save(path: str, model: Any, optimizer: Any, epoch: int) -> None:
    """What save_sharded should do: model, optimizer (by parameter name) and epoch, every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "epoch": epoch}, checkpoint_id=path)


def reference_load(path: str, model: Any, optimizer: Any) -> int:
    """What load_resharded should do: load into this model's own layout, then set it; the epoch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "epoch": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["epoch"]


def _keys(path: str) -> list[str] | str:
    import torch.distributed.checkpoint as dcp

    if not os.path.exists(os.path.join(path, ".metadata")):
        return "<no .metadata: not a torch.distributed.checkpoint>"
    return sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def _full(model: Any) -> Any:
    from ddplab.sharding import full_weights

    return full_weights(model)


def _step(model: Any, optimizer: Any, start: int) -> None:
    """On a rank: one Adam step on 8 digits of its own, from sample ``start``, in float64."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ddplab.sharding import digits_batch

    x, y = digits_batch(8, start=start + 8 * dist.get_rank(), dtype=torch.float64)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def _save_answers(student: Callable, folder: str) -> dict:
    import torch.distributed as dist

    model, optimizer = _fsdp(seed=0)
    for i in range(2):
        _step(model, optimizer, 40 * i)
    ref_path, path = os.path.join(folder, "reference"), os.path.join(folder, "student")
    reference_save(ref_path, model, optimizer, 3)
    with refusing_library((REFERENCES,), "save_sharded", builds="a sharded checkpoint"):
        student(path, model, optimizer, 3)
    dist.barrier()
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp")) if os.path.isdir(path) else []
    out = {"expected": _keys(ref_path), "got": _keys(path), "files": len(files), "loaded": False}
    if isinstance(out["got"], list) and out["got"] == out["expected"]:
        fresh, adam = _fsdp(seed=9)
        epoch = reference_load(path, fresh, adam)
        _step(model, optimizer, 200)
        _step(fresh, adam, 200)                    # equal after a step: Adam's state came back too
        out["loaded"] = bool(epoch == 3 and (_full(fresh) - _full(model)).abs().max().item() <= 1e-12)
    return out


@checker
def save_sharded(lab: Any = None) -> None:
    """Check ``save_sharded(path, model, optimizer, epoch)`` on an FSDP2 model and its Adam."""
    __tracebackhide__ = True
    n = lab.world_size
    with _Folder() as folder:
        got = _student("save_sharded", lab, _save_answers, folder)
    keys, expected = got[0]["got"], got[0]["expected"]
    optim = [k for k in keys if k.startswith("optim.state.")] if isinstance(keys, list) else []
    if isinstance(keys, str):
        hint = ("a sharded checkpoint is torch.distributed.checkpoint's, saved by every rank; "
                "torch.save writes one file, of one rank's shard only.")
    elif not optim:
        hint = ("no optimizer state: Adam's exp_avg and exp_avg_sq are needed to resume, save them "
                "under 'optim'.")
    elif any(k.count(".") == 3 for k in optim):          # optim.state.0.exp_avg: by number
        hint = ("the optimizer state is keyed by parameter number (optimizer.state_dict()): take both "
                "from get_state_dict(model, optimizer), which keys them by name, so that any layout "
                "can load them.")
    elif set(keys) > set(expected):
        extra = sorted(set(keys) - set(expected))[:3]
        hint = (f"save only what must be saved: {extra} is not needed to resume (gradients are "
                f"recomputed in the next step; data is read again).")
    else:
        hint = ("the checkpoint holds three things under 'model', 'optim' and 'epoch', the first "
                "two as get_state_dict gives them.")

    def difference(g: dict) -> Any:
        if isinstance(g["got"], str):
            return g["got"]
        return {"missing": sorted(set(g["expected"]) - set(g["got"]))[:4],
                "extra": sorted(set(g["got"]) - set(g["expected"]))[:4]}

    compare("the keys in the checkpoint's metadata (at most 4 of each shown)",
            [{"missing": [], "extra": []}] * n, [difference(g) for g in got], hint=hint)
    compare("the .distcp files in the checkpoint (one per rank)", [n] * n, [g["files"] for g in got],
            hint="every rank must call dcp.save: each writes its own shard.")
    holds("a fresh FSDP2 model loaded from it equals the saved one, one Adam step later",
          [g["loaded"] for g in got],
          hint="save the model and optimizer state as they are at the call, and the epoch given.")
    passed("every rank wrote its own shard, and the checkpoint holds the model, the optimizer "
           "state by parameter name and the epoch: nothing more.")


# --------------------------------------------------------------- load_resharded
def _load_answers(student: Callable, folder: str) -> dict:
    source, source_adam = _fsdp(seed=0)
    for i in range(3):
        _step(source, source_adam, 40 * i)
    path = os.path.join(folder, "ckpt")
    reference_save(path, source, source_adam, 5)
    out = {}
    for layout, make in (("FSDP2", _fsdp), ("DDP", _ddp)):
        model, adam = make(seed=7)
        _step(model, adam, 300)                    # a state of its own that loading must replace
        with refusing_library((REFERENCES,), "load_resharded", builds="a resharded load"):
            epoch = student(path, model, adam)
        weights = bool((_full(model) - _full(source)).abs().max().item() <= 1e-12)
        out[layout] = {"epoch": epoch if isinstance(epoch, int) else repr(epoch), "weights": weights}
        if weights:
            copy, copy_adam = _fsdp(seed=0)
            reference_load(path, copy, copy_adam)
            _step(copy, copy_adam, 200)
            _step(model, adam, 200)
            weights = bool((_full(model) - _full(copy)).abs().max().item() <= 1e-12)
        out[layout]["adam"] = weights
    return out


@checker
def load_resharded(lab: Any = None) -> None:
    """Check ``load_resharded(path, model, optimizer)``: an FSDP2 checkpoint into FSDP2 and DDP."""
    __tracebackhide__ = True
    n = lab.world_size
    with _Folder() as folder:
        got = _student("load_resharded", lab, _load_answers, folder)
    for layout in ("FSDP2", "DDP"):
        holds(f"a {layout} model holds the saved weights after load_resharded",
              [g[layout]["weights"] for g in got],
              hint="load into the state dicts of *this* model (they say which shard each rank "
                   "wants), then set them into the model and the optimizer.")
        holds(f"a {layout} model one Adam step after load_resharded equals the saved run's",
              [g[layout]["adam"] for g in got],
              hint="load the optimizer state too ('optim'), and set it: Adam's moments decide the "
                   "next step.")
        compare(f"the epoch load_resharded returned ({layout})", [5] * n,
                [g[layout]["epoch"] for g in got],
                hint="put 'epoch' in the dict you dcp.load into; it comes back there: return it.")
    passed("a checkpoint saved from FSDP2 shards loads into FSDP2 and into DDP, weights and Adam's "
           "state, and gives back its epoch.")


# --------------------------------------------------------------- resumable_train
def _train_answers(student: Callable, folder: str, epochs: int) -> dict:
    """On a rank: uninterrupted, stopped and resumed, with ``save_state`` and ``load_state`` torch's
    own save and load (the notebook's, whatever the namespace holds now): the loop is what is checked."""
    from ddplab.rank.engine import namespace

    ns = namespace()
    names = ("save_state", "load_state")
    kept = {name: ns[name] for name in names if name in ns}
    calls: list[str] = []                          # what the resumed run loaded and saved

    def save_state(path, *args, **kwargs):
        calls.append(f"save {os.path.basename(path)}")
        return reference_save(path, *args, **kwargs)

    def load_state(path, *args, **kwargs):
        calls.append(f"load {os.path.basename(path)}")
        return reference_load(path, *args, **kwargs)

    ns.update(save_state=reference_save, load_state=reference_load)
    try:
        whole = student(os.path.join(folder, "whole"), epochs)
        first = student(os.path.join(folder, "resumed"), epochs, stop_after=1)
        ns.update(save_state=save_state, load_state=load_state)
        resumed = student(os.path.join(folder, "resumed"), epochs)
    finally:
        for name in names:                         # the student's own again, or none as before
            if name in kept:
                ns[name] = kept[name]
            else:
                ns.pop(name, None)
    written = sorted(os.listdir(os.path.join(folder, "resumed")))
    ok = all(hasattr(w, "shape") for w in (whole, first, resumed))
    return {"resumed_calls": calls,
            "equal": ok and bool((whole - resumed).abs().max().item() <= 1e-12),
            "stopped_early": ok and bool((whole - first).abs().max().item() > 0),
            "written": written}


@checker
def resumable_train(lab: Any = None) -> None:
    """Check ``train(path, epochs, stop_after=None)``: stopped after epoch 1, resumed, as if uninterrupted."""
    __tracebackhide__ = True
    n, epochs = lab.world_size, 3
    with _Folder() as folder:
        got = _student("train", lab, _train_answers, folder, epochs)
    compare("the checkpoints in path after a run stopped after epoch 1 and resumed",
            [[f"epoch{e}" for e in range(1, epochs + 1)]] * n, [g["written"] for g in got],
            hint="save one checkpoint per epoch, in os.path.join(path, f'epoch{epoch + 1}'), after "
                 "the epoch's last step.")
    holds("train(path, 3, stop_after=1) stops early (its weights differ from a whole run's)",
          [g["stopped_early"] for g in got],
          hint="return right after saving the checkpoint of epoch stop_after.")
    compare("what the resumed run loaded and saved (load_state / save_state, by folder)",
            [["load epoch1", *(f"save epoch{e}" for e in range(2, epochs + 1))]] * n,
            [g["resumed_calls"] for g in got],
            hint="resume: load the newest checkpoint (latest(path)) once, before the first epoch, and "
                 "train only the epochs after it; a run that starts over from epoch 0 is a new run, "
                 "not a resumed one, even when it ends with the same weights.")
    holds("a run stopped after epoch 1 and resumed ends with an uninterrupted run's weights (to "
          "1e-12)", [g["equal"] for g in got],
          hint="after loading, start at the saved epoch, and give the sampler the true epoch number "
               "in every epoch: a sampler left at epoch 0 (or set to the count since the restart) "
               "shuffles the resumed epochs as epoch 0 did, and the run diverges.")
    passed("stopped after epoch 1 and resumed, the run ends with exactly the weights of an "
           "uninterrupted one.")


# --------------------------------------------------------------- async_checkpoint
def _async_answers(student: Callable, folder: str) -> dict:
    import threading
    from concurrent.futures import Future

    import torch
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = _fsdp(seed=0)
    _step(model, optimizer, 0)
    expected = _full(model).clone()
    path = os.path.join(folder, "async")
    # Which threads write the files: dcp.async_save writes in a thread of its own; a dcp.save
    # in the call writes in the caller's, however its result is wrapped afterwards.
    writer = next(c for c in FileSystemWriter.__mro__ if "write_data" in c.__dict__)
    raw_write, writing_threads = writer.write_data, []

    def write_data(self, *args, **kwargs):
        writing_threads.append(threading.get_ident())
        return raw_write(self, *args, **kwargs)

    writer.write_data = write_data
    try:
        future = student(path, model, optimizer, 4)
        is_future = isinstance(future, Future)
        kind = type(future)
        returned = "None" if future is None else \
            f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
        with torch.no_grad():                          # training goes on while the write runs
            for p in model.parameters():
                p.add_(1.0)
        if is_future:
            future.result()
    finally:
        writer.write_data = raw_write
    torch.distributed.barrier()
    out = {"future": is_future, "returned": returned, "keys": _keys(path),
           "state_at_call": False,
           "background": bool(writing_threads) and threading.get_ident() not in writing_threads}
    if isinstance(out["keys"], list):
        fresh, adam = _fsdp(seed=9)
        epoch = reference_load(path, fresh, adam)
        out["state_at_call"] = bool(epoch == 4 and (_full(fresh) - expected).abs().max().item() <= 1e-12)
    return out


@checker
def async_checkpoint(lab: Any = None) -> None:
    """Check ``async_checkpoint(path, model, optimizer, epoch)``: dcp.async_save's future, the state
    at the call."""
    __tracebackhide__ = True
    with _Folder() as folder:
        got = _student("async_checkpoint", lab, _async_answers, folder)
    wrong = [rank for rank, g in enumerate(got) if not g["future"]]
    if wrong:
        said = {g["returned"] for g in got if not g["future"]}
        raise Feedback(f"async_checkpoint returned {' / '.join(sorted(said))} on {ranks_phrase(wrong)}, "
                       f"not a concurrent.futures.Future.",
                       rows=[Row(rank, g["returned"], "a concurrent.futures.Future", rank in wrong)
                             for rank, g in enumerate(got)],
                       hint="return the future torch's asynchronous save gives: the caller waits on "
                            "it (future.result()) before the next save, not now.")
    holds("the checkpoint's files are written in a background thread, after the call returned",
          [g["background"] for g in got],
          hint="a save made inside async_checkpoint writes every file before it returns, however "
               "its result is wrapped: let torch's asynchronous save write in its own thread.")
    holds("a checkpoint is in path once the future is done", [isinstance(g["keys"], list) for g in got],
          hint="every rank saves, asynchronously, to checkpoint_id=path.")
    holds("the checkpoint holds the weights as they were at the call, though training changed them "
          "right after", [g["state_at_call"] for g in got],
          hint="save 'model', 'optim' and 'epoch' as in save_sharded, with torch's asynchronous "
               "save, which copies (stages) the state before it returns.")
    passed("async_checkpoint returns at once with a future, and the checkpoint holds the state at "
           "the call, although training went on.")
