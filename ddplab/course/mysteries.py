"""The buggy programs of notebook 09: each one hides one bug, and a seed decides where.

    bug = ddplab.check.mystery("flight")    # a ``Mystery``: seed 0's program, as the notebook shows it
    print(bug)                              # its source, with line numbers
    dumps = bug.run()                       # run on the lab's ranks with its tool: what the tool shows

A *mystery* is a short program (its source, written to a file so that stacks
and tracebacks name real lines) with one distributed bug in it, and the truth
about that bug: which rank, which collective, which op, which line. The seed
picks the variant: which rank is short of batches, which step goes wrong,
which function waits. The notebook shows the learner one variant (seed 0);
the checker runs another the learner never saw and hands its tool output to
the learner's own diagnosis function, so what is graded is the method of
reading the tool, not a number copied from the page.

Kinds, and the tool each is read with:

- ``flight``: a rank runs out of batches; the other waits in a collective it
  never joins (torch's flight recorder, one dump per rank).
- ``detail``: one rank calls a different collective at one step
  (``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s fingerprint check, its message).
- ``unused``: a model with a layer its forward skips (DDP's error at ``INFO``).
- ``stacks``: a rank waits for a file that never comes, outside any
  collective (``faulthandler``'s dump of every thread, per rank).
- ``torchrun``: a rank raises at one line of a torchrun script (torchrun's
  ``--tee`` output).

On the ranks, ``run_on_rank`` runs a program in a process group of its own
with a short timeout (a hang ends in about a second, and the lab's own group
is left as it was) and returns what the tool shows. Course content, not a
checker: notebook 09's checkers (``ddplab.check.nb09_debugging``) run variants
of these programs and grade the learner's reading of their tools.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

#: Seconds a program's group waits in a collective before it gives up (the hang, made short).
GROUP_TIMEOUT = 1.0
#: Seconds a mystery run may take on the ranks (its own group gives up after about one).
TIMEOUT = 30.0
KINDS = ("flight", "detail", "unused", "stacks", "torchrun")

_CALL = {
    "all_reduce": "dist.all_reduce(x, group=group)",
    "broadcast": "dist.broadcast(x, src=0, group=group)",
    "all_gather": "dist.all_gather([torch.empty_like(x), torch.empty_like(x)], x, group=group)",
}
#: What DETAIL's fingerprint calls each op (``OpType=...``).
OP_TYPE = {"all_reduce": "ALLREDUCE", "broadcast": "BROADCAST", "all_gather": "ALLGATHER"}


@dataclass
class Program:
    """One variant of a mystery: its kind, seed, source, and the truth the checker knows."""
    kind: str
    seed: int
    source: str
    truth: dict = field(repr=False)


def make(kind: str, seed: int) -> Program:
    """The program of ``kind`` that ``seed`` picks (the same program for the same seed)."""
    if kind not in KINDS:
        raise ValueError(f"ddplab: no mystery of kind {kind!r}; expected one of {KINDS}.")
    rng = random.Random(f"{kind}-{seed}")
    source, truth = globals()[f"_{kind}"](rng)
    return Program(kind, seed, source, truth)


def _line_of(source: str, marker: str) -> int:
    """The line number (from 1) of the line holding ``marker``; the marker is then removed."""
    return next(n for n, line in enumerate(source.splitlines(), 1) if marker in line)


def _flight(rng: random.Random) -> tuple[str, dict]:
    short = rng.randrange(2)
    batches = rng.randrange(1, 4)
    ops = rng.sample(sorted(_CALL), 2)
    counts = {short: batches, 1 - short: batches + rng.randrange(1, 3)}
    source = f'''"""Each rank trains on its own shard of the data."""
import torch
import torch.distributed as dist

SHARD_BATCHES = {{0: {counts[0]}, 1: {counts[1]}}}   # the data was split by hand


def train_step(x, group):
    {_CALL[ops[0]]}
    {_CALL[ops[1]]}


def main(group):
    x = torch.ones(4)
    for _ in range(SHARD_BATCHES[dist.get_rank()]):
        train_step(x, group)
'''
    return source, {"rank": short, "collective": 2 * batches + 1, "op": ops[0]}


def _detail(rng: random.Random) -> tuple[str, dict]:
    rank, step = rng.randrange(2), rng.randrange(3)
    every, extra = rng.sample(sorted(_CALL), 2)
    source = f'''"""Training steps; one rank also reports a metric at one step."""
import torch
import torch.distributed as dist


def main(group):
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(3):
        dist.all_reduce(x, group=group)               # the gradients
        if rank == {rank} and step == {step}:
            {_CALL[extra]}
        {_CALL[every]}
'''
    ops = {rank: OP_TYPE[extra], 1 - rank: OP_TYPE[every]}
    return source, {"collective": 2 * step + 2, "ops": ops}


_LAYERS = ("encoder", "head", "aux", "proj", "gate")


def _unused(rng: random.Random) -> tuple[str, dict]:
    used, skipped = rng.sample(_LAYERS, 2)
    source = f'''"""A model with two layers; its forward uses one of them."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.{used} = torch.nn.Linear(4, 1)
        self.{skipped} = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.{used}(x)


def main(group):
    model = DDP(TwoLayers(), process_group=group)
    for step in range(2):
        model(torch.ones(2, 4)).sum().backward()
'''
    return source, {"parameters": {f"{skipped}.weight", f"{skipped}.bias"}}


_WAITERS = ("wait_for_checkpoint", "wait_for_shard", "wait_for_config")


def _stacks(rng: random.Random) -> tuple[str, dict]:
    rank, step, waiter = rng.randrange(2), rng.randrange(3), rng.choice(_WAITERS)
    notes = "\n".join(f"    # {note}" for note in rng.sample(
        ["rank 0 writes the file", "the others poll for it", "patience is in seconds",
         "a shared file system can be slow"], rng.randrange(1, 4)))
    source = f'''"""Training steps; at one step a rank waits for a file rank 0 should have written."""
import os
import time

import torch
import torch.distributed as dist


def {waiter}(path, patience={GROUP_TIMEOUT}):
{notes}
    waited = 0.0
    while not os.path.exists(path):
        if waited >= patience:
            raise TimeoutError(f"{{path}} never appeared")
        time.sleep(patience)                      # STUCK
        waited += patience


def train_step(x, group):
    dist.all_reduce(x, group=group)


def main(group):
    x = torch.ones(4)
    for step in range(3):
        if dist.get_rank() == {rank} and step == {step}:
            {waiter}("/nonexistent/step-{step}.pt")
        train_step(x, group)
'''
    line = _line_of(source, "# STUCK")
    return source.replace("                      # STUCK", ""), {
        "rank": rank, "function": waiter, "line": line}


_ERRORS = {
    "IndexError": ("batch = shards[rank][step]", "shards = {{{rank}: [1.0] * {n}, {other}: "
                                                 "[1.0] * 4}}"),
    "KeyError": ("batch = shards[rank][f'batch-{step}']", "shards = {{{rank}: {{f'batch-{{i}}': "
                 "1.0 for i in range({n})}}, {other}: {{f'batch-{{i}}': 1.0 for i in range(4)}}}}"),
    "ZeroDivisionError": ("batch = 1.0 / (len(shards[rank]) - step)",
                          "shards = {{{rank}: [1.0] * {n}, {other}: [1.0] * 8}}"),
}


def _torchrun(rng: random.Random) -> tuple[str, dict]:
    rank, error, n = rng.randrange(2), rng.choice(sorted(_ERRORS)), rng.randrange(1, 3)
    use, shards = _ERRORS[error]
    blank = "\n" * rng.randrange(1, 4)
    source = f'''"""A torchrun script: each rank reads its batches from its own shard."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
{shards.format(rank=rank, other=1 - rank, n=n)}
{blank}
for step in range(4):
    {use}                                   # RAISES
    loss = torch.tensor(batch)
    dist.all_reduce(loss)
dist.destroy_process_group()
'''
    line = _line_of(source, "# RAISES")
    return source.replace("                                   # RAISES", ""), {
        "rank": rank, "error": error, "line": line}


# ------------------------------------------------------------------ in the notebook
class Mystery:
    """A buggy program: ``print(bug)`` shows it with line numbers, ``bug.run()`` runs it with its tool.

    ``bug.path`` is its file (in a scratch folder every rank can read); what
    ``run()`` returns depends on the tool: a list by rank of flight recorder
    dumps, of error messages or of faulthandler stacks, or, for ``torchrun``,
    the launcher's output.
    """

    def __init__(self, kind: str, seed: int = 0, folder: str | None = None) -> None:
        self.program = make(kind, seed)
        self.kind = kind
        if folder is None:
            from ..lab.scratch import scratch_folder
            folder = scratch_folder("mystery")
        self.path = os.path.join(folder, f"{kind}.py" if seed == 0 else f"{kind}_v{seed}.py")
        with open(self.path, "w") as f:
            f.write(self.program.source)

    @property
    def source(self) -> str:
        return self.program.source

    def __str__(self) -> str:
        lines = self.source.rstrip().splitlines()
        return "\n".join(f"{n:3d}  {line}".rstrip() for n, line in enumerate(lines, 1))

    def run(self, lab: Any = None) -> Any:
        """Run the program with its tool on the lab's ranks (torchrun: as a torchrun job)."""
        from ..lab.current_lab import current
        if self.kind == "torchrun":
            from .. import launch
            result = launch.torchrun(self.path, tee=3, check=False, timeout=60)
            return result.launcher_output
        lab = lab if lab is not None else current()
        return lab.run(run_on_rank, self.kind, self.source, self.path, timeout=TIMEOUT)

    def run_as_a_cell(self, timeout: float = 2.0, lab: Any = None) -> Any:
        """Run the program as a cell of yours would run it: a hang is ddplab's ``HangError``.

        The program's group waits far longer than ``timeout``, so when the lab
        gives up the ranks are still stuck, and the ``HangError`` says where, from
        the flight recorder. Stuck ranks need ``lab.restart()`` afterwards.
        """
        from ..lab.current_lab import current
        lab = lab if lab is not None else current()
        return lab.run(run_on_rank, self.kind, self.source, self.path, 10 * TIMEOUT,
                       timeout=timeout)


def mystery(kind: str, seed: int = 0) -> Mystery:
    """The program of notebook 09's section ``kind`` (seed 0 is the one the notebook shows)."""
    return Mystery(kind, seed)


# ------------------------------------------------------------------ on a rank
def run_on_rank(kind: str, source: str, path: str, group_timeout: float = GROUP_TIMEOUT) -> object:
    """Run a mystery's ``main(group)`` on this rank in a group of its own; what the tool shows.

    ``flight``: this rank's flight recorder dump (``_dump_fr_trace_json``), its
    entries those of the program's group only;
    ``detail`` / ``unused``: the error's message; ``stacks``: faulthandler's dump
    of every thread, taken while the program is stuck.
    """
    import datetime
    import faulthandler
    import json

    import torch
    import torch.distributed as dist

    level = {"detail": dist.DebugLevel.DETAIL, "unused": dist.DebugLevel.INFO}.get(kind)
    before = dist.get_debug_level()
    if level is not None:
        dist.set_debug_level(level)          # groups and DDP made from here on see it
    try:
        group = dist.new_group(backend="gloo",
                               timeout=datetime.timedelta(seconds=group_timeout))
        if kind == "unused":
            namespace = _load(source, path)
            namespace["DDP"] = _ddp_at(level, namespace["DDP"])
        else:
            namespace = _load(source, path)
    finally:
        dist.set_debug_level(before)
    stacks = path + f".stacks-{dist.get_rank()}"
    message = ""
    with open(stacks, "w") as out:
        if kind == "stacks":
            faulthandler.dump_traceback_later(group_timeout * 0.5, file=out)
        try:
            namespace["main"](group)
        except Exception as e:  # noqa: BLE001 - the bug's error is what the tool shows
            message = str(e)
        finally:
            faulthandler.cancel_dump_traceback_later()
    if kind == "flight":
        dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
        name = group.group_name
        dump["entries"] = [e for e in dump.get("entries", [])
                           if e.get("process_group", [None])[0] == name]
        return dump
    if kind == "stacks":
        with open(stacks) as f:
            return f.read()
    return message


def _ddp_at(level: object, ddp: type) -> object:
    """DDP made with the debug level on: its reducer reads the level when it is built."""
    import torch.distributed as dist

    def make(*args: object, **kwargs: object) -> object:
        before = dist.get_debug_level()
        dist.set_debug_level(level)
        try:
            return ddp(*args, **kwargs)
        finally:
            dist.set_debug_level(before)
    return make


def _load(source: str, path: str) -> dict:
    """The program's globals, run from ``path`` so that its frames name that file's lines."""
    namespace: dict = {"__name__": "mystery", "__file__": path}
    exec(compile(source, path, "exec"), namespace)
    return namespace
