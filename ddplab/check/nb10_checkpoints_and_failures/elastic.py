"""Checker for notebook 10's torchrun restart: a job that resumes from its newest complete checkpoint.

- ``torchrun_resume()``: ``resume(folder, model, optimizer)`` loads the newest
  *complete* checkpoint in ``folder`` (``epoch<N>`` folders; complete: it has
  its ``.metadata``) into the model and optimizer and returns the epoch to
  start at, 0 when there is none. The check runs the check's own training
  script under ``torchrun --max-restarts 1`` with it: rank 1 is killed in
  epoch 2 of the first attempt, and the folder already holds an ``epoch3``
  whose save died (its ``.distcp`` without ``.metadata``). The second attempt
  must resume at epoch 2, not start over, and the job must end with the
  weights of an uninterrupted run on the lab's ranks. First, in a second and
  on the lab's ranks, ``resume`` is tried on a folder of two complete
  checkpoints and a dead one: most mistakes are named there, before any job.

torchrun is started from rank 0 of the lab, where the student's code already
runs: the function goes to the job's workers pickled by value (cloudpickle).
"""

from __future__ import annotations

import os
from typing import Any

from .._core import checker, compare, holds, passed, run_student_code
from .._feedback import Feedback, Row, ranks_phrase

__all__ = ["torchrun_resume"]

_TIMEOUT = 240.0
EPOCHS, KILL_EPOCH = 4, 2

#: The job: notebook 10's elastic_train.py, with the student's resume in place of its loading.
SCRIPT = '''"""Train 4 epochs with DDP, a DCP checkpoint after each; resume with the given resume()."""
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddplab import data, sharding

EPOCHS, KILL_EPOCH = {epochs}, {kill_epoch}
HERE = os.path.dirname(os.path.abspath(__file__))


def make_run():
    train_set, _ = data.digits(dtype=torch.float64)
    subset = Subset(train_set, range(96))
    sampler = DistributedSampler(subset, shuffle=True, seed=0)
    model = DDP(sharding.mlp(seed=0, dtype=torch.float64))
    return (model, torch.optim.Adam(model.parameters(), lr=1e-2), sampler,
            DataLoader(subset, batch_size=16, sampler=sampler))


def train(folder, resume, kill=False):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(folder, exist_ok=True)
    model, optimizer, sampler, loader = make_run()
    start = resume(folder, model, optimizer)
    print(f"attempt {{attempt}}: resumed at epoch {{start!r}}", flush=True)
    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            if kill and attempt == 0 and dist.get_rank() == 1 and (epoch, step) == (KILL_EPOCH, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({{"model": model_state, "optim": optim_state, "epoch": epoch + 1}},
                 checkpoint_id=os.path.join(folder, f"epoch{{epoch + 1}}"))
    return sharding.full_weights(model)


if __name__ == "__main__":
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{{attempt}}", store),
                            rank=rank, world_size=world_size)
    with open(os.path.join(HERE, "resume.pkl"), "rb") as f:
        resume = pickle.load(f)
    weights = train(os.path.join(HERE, "checkpoints"), resume, kill=True)
    if dist.get_rank() == 0:
        torch.save(weights, os.path.join(HERE, "final.pt"))
    dist.destroy_process_group()
    # Straight out, past the interpreter's teardown: there, 1 run in 4 of torch 2.13's gloo
    # aborted ("terminate called without an active exception") after all the work was done.
    sys.stdout.flush()
    os._exit(0)
'''


def reference_resume(folder: str, model: Any, optimizer: Any) -> int:
    """What resume should do: the newest epoch folder with a .metadata, loaded; its epoch, or 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    done = [int(name[5:]) for name in os.listdir(folder) if name.startswith("epoch")
            and os.path.exists(os.path.join(folder, name, ".metadata"))] if os.path.isdir(folder) else []
    if not done:
        return 0
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "epoch": 0}
    dcp.load(state, checkpoint_id=os.path.join(folder, f"epoch{max(done)}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["epoch"]


# ------------------------------------------------------------------ on a rank
def _in_lab(folder: str) -> dict:
    """On every rank, before any torchrun: resume on a folder of two complete checkpoints and one
    whose save died. A mistake found here costs a second, not a job."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.rank.engine import namespace
    from ddplab.sharding import full_weights, mlp, train_steps

    student = namespace().get("resume")
    if not callable(student):
        return {"missing": True}
    for epoch in (1, 2):
        model = DDP(mlp(seed=epoch, dtype=torch.float64))
        adam = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_steps(model, adam, steps=1, dtype=torch.float64)
        model_state, optim_state = get_state_dict(model, adam)
        dcp.save({"model": model_state, "optim": optim_state, "epoch": epoch},
                 checkpoint_id=os.path.join(folder, f"epoch{epoch}"))
    saved = full_weights(model)
    if dist.get_rank() == 0:
        _dead_save(folder)
    dist.barrier()
    model = DDP(mlp(seed=7, dtype=torch.float64))
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        start = student(folder, model, adam)
    except NotImplementedError:                 # the stub: reported as any code that raised
        raise
    except (Exception, CheckpointException) as exc:    # named below (DCP's is a BaseException)
        text = str(exc)
        last = [line.strip() for line in text.splitlines() if line.strip()][-1:] or [""]
        return {"missing": False, "raised": f"{type(exc).__name__}: {last[0][:160]}",
                "metadata": ".metadata" in text}
    return {"missing": False, "raised": None, "start": start if isinstance(start, int) else repr(start),
            "weights": bool((full_weights(model) - saved).abs().max().item() == 0)}


def _dead_save(folder: str) -> None:
    """A checkpoint folder as a save killed while writing leaves it: data, no .metadata."""
    dead = os.path.join(folder, f"epoch{KILL_EPOCH + 1}")
    os.makedirs(dead, exist_ok=True)
    with open(os.path.join(dead, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 64)


def _job(folder: str) -> dict:
    """On rank 0: the job under torchrun with the student's resume; its attempts and lines."""
    import cloudpickle

    from ddplab import launch
    from ddplab.rank.engine import namespace

    student = namespace().get("resume")
    if not callable(student):
        return {"missing": True}
    with open(os.path.join(folder, "resume.pkl"), "wb") as f:
        cloudpickle.dump(student, f)
    script = os.path.join(folder, "resume_train.py")
    with open(script, "w") as f:
        f.write(SCRIPT.format(epochs=EPOCHS, kill_epoch=KILL_EPOCH))
    _dead_save(os.path.join(folder, "checkpoints"))
    result = launch.torchrun(script, nproc_per_node=2, max_restarts=1, timeout=_TIMEOUT - 40,
                             check=False)
    lines = {rank: [line for line in text.splitlines() if line.startswith("attempt ")]
             for rank, text in result.rank_output.items()}
    errors = {rank: [line for line in text.splitlines() if "Error" in line][-1:]
              for rank, text in result.rank_output.items()}
    return {"missing": False, "ok": result.ok, "attempts": result.attempts, "lines": lines,
            "errors": errors, "final": os.path.exists(os.path.join(folder, "final.pt"))}


def _uninterrupted(folder: str) -> Any:
    """On every rank: the job's training, never killed, from an empty folder (the reference resume)."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("ddplab_resume_train",
                                                  os.path.join(folder, "resume_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):        # its "attempt 0" line is not the job's
        return module.train(os.path.join(folder, "clean"), reference_resume)


# --------------------------------------------------------------------- the check
def _check_in_lab(lab: Any, folder: str) -> None:
    __tracebackhide__ = True
    n = lab.world_size
    got = run_student_code("resume(...)", _in_lab, folder, lab=lab, timeout=_TIMEOUT,
                           hint="dcp.load and set_state_dict are collectives: every rank calls them.")
    if got[0]["missing"]:
        raise Feedback("no function `resume` on the ranks.",
                       hint="run the exercise cell above (%%ranks) and keep the name `resume`.")
    raised = [g["raised"] for g in got]
    dead = f"epoch{KILL_EPOCH + 1}"
    if any(g.get("metadata") for g in got):
        hint = (f"dcp.load failed on a folder without .metadata ({dead}: a save that died while "
                f"writing). Take the newest *complete* checkpoint: DCP writes .metadata last.")
    else:
        hint = ""
    failed = [rank for rank, r in enumerate(raised) if r is not None]
    if failed:
        raise Feedback(f"resume(...) raised on {ranks_phrase(failed)}, on a folder holding epoch1, "
                       f"epoch2 and a dead {dead}.",
                       rows=[Row(rank, str(raised[rank]), wrong=True) for rank in failed], hint=hint)
    starts = [g["start"] for g in got]
    compare(f"the epoch resume returned for epoch1, epoch2 and {dead} (no .metadata)", [2] * n, starts,
            hint=(f"{dead} has no .metadata: its save died. Only a folder with .metadata is a "
                  f"checkpoint." if starts[0] == KILL_EPOCH + 1 else
                  "with complete checkpoints in the folder, a job that started over at epoch 0 is a "
                  "new run, not a resumed one: load the newest and return its epoch."
                  if starts[0] == 0 else
                  "return the saved 'epoch' of the checkpoint you loaded (it comes back in the dict "
                  "you dcp.load into)."),
            show_expected="the epoch after the newest complete checkpoint")
    holds("the model's weights after resume are epoch2's", [g["weights"] for g in got],
          hint="load the newest complete checkpoint into the model and the optimizer.")


@checker
def torchrun_resume(lab: Any = None) -> None:
    """Check ``resume(folder, model, optimizer)`` in a job killed and restarted by torchrun."""
    __tracebackhide__ = True
    import shutil
    import tempfile

    import torch

    folder = tempfile.mkdtemp(prefix="ddplab-check-elastic-")
    try:
        _check_in_lab(lab, os.path.join(folder, "in-lab"))
        job = run_student_code("the torchrun job with resume(...)", _job, folder, lab=lab,
                               timeout=_TIMEOUT, hint="", ranks=[0])[0]
        expected = ["attempt 0: resumed at epoch 0", f"attempt 1: resumed at epoch {KILL_EPOCH}"]
        got_lines = [job["lines"].get(rank, []) for rank in (0, 1)]
        if not job["ok"]:
            raised = sorted({e for rank in job["errors"].values() for e in rank}) or ["(no error line)"]
            hint = f"the job failed, its workers ending with: {' / '.join(raised)[:300]}."
            if ".metadata" in hint:
                hint += (f" Take the newest checkpoint that is complete: a folder without .metadata "
                         f"is a save that died (the check leaves one, epoch{KILL_EPOCH + 1}), and "
                         f"dcp.load refuses it.")
        elif any(lines[-1:] == ["attempt 1: resumed at epoch 0"] for lines in got_lines):
            hint = ("the restarted attempt started over at epoch 0: that is a new run, not a resumed "
                    "one. Load the newest complete checkpoint and return its epoch.")
        else:
            hint = ("return the epoch to start at: the saved 'epoch' of the checkpoint loaded (0 "
                    "when the folder holds no complete checkpoint).")
        compare("what each attempt of the job printed (its start epoch)", [expected, expected],
                got_lines, hint=hint)
        weights = run_student_code("the uninterrupted run", _uninterrupted, folder, lab=lab,
                                   timeout=_TIMEOUT, hint="")
        final = torch.load(os.path.join(folder, "final.pt")) if job["final"] else None
        same = [final is not None and bool((w - final).abs().max().item() <= 1e-12) for w in weights]
        holds("the job's final weights are an uninterrupted run's (to 1e-12)", same,
              hint="load the model's and the optimizer's state: Adam's moments decide the steps "
                   "after the restart.")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    passed("killed and restarted by torchrun, the job resumed from its newest complete checkpoint, "
           "past the one whose save died, and ended with the weights of an uninterrupted run.")
