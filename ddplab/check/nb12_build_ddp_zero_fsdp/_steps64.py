"""What notebook 12's checks share: a tiny float64 model, its batches, and one process as the reference.

Every build-it check trains ``model()`` for ``STEPS`` steps on the ranks with
the student's code, each rank on its rows of the step's batch (drawn by the
checker from a seed no rank sees, ``drawn``; each rank is sent only its rows,
``each_rank``), and compares the weights with ``one_process``: the same model
trained in this process on the whole batch, in float64, to ``TOLERANCE``. ``verdict`` turns a
mismatch into the mistake that explains it (gradients averaged twice, never
averaged, a step computed in float32). ``AllReduceLog`` records the student's ``dist.all_reduce`` calls
(when, how big, waited for or not) so a check can read their order.
"""

from __future__ import annotations

from typing import Any

from .._core import FLOAT32_HINT
from .._feedback import Feedback, float32_rounding

#: torch's own versions of what notebook 12 builds: a check refuses them (``refusing_library``).
LIBRARY = ("DistributedDataParallel", "ZeroRedundancyOptimizer", "fully_shard",
           "FullyShardedDataParallel")
STEPS = 3
TOLERANCE = 1e-12
TIMEOUT = 60.0


def model() -> Any:
    """``sharding.tiny_mlp()``: Linear 6->10, tanh, 10->10, tanh, 10->3, float64, the same everywhere."""
    from ...sharding import tiny_mlp

    return tiny_mlp()


def drawn(world: int, steps: int = STEPS) -> list[tuple[Any, Any]]:
    """In the checker: each step's whole batch, ``sharding.tiny_batch``'s shapes, from a seed drawn now.

    No rank sees the seed, and each is sent only its own rows (``rows_of``):
    the whole batch, which the averaged gradient stands for, a rank knows only
    by communicating.
    """
    import secrets

    import torch

    from ...sharding import TINY_ROWS

    g = torch.Generator().manual_seed(secrets.randbits(62))
    size = TINY_ROWS * world
    return [(torch.randn(size, 6, generator=g, dtype=torch.float64),
             torch.randn(size, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def rows_of(batches: list[tuple[Any, Any]], rank: int, world: int) -> list[tuple[Any, Any]]:
    """Rank ``rank``'s rows of each batch: the ``rank``-th of ``world`` equal parts."""
    return [(x.chunk(world)[rank].clone(), y.chunk(world)[rank].clone()) for x, y in batches]


def each_rank(batches: list[tuple[Any, Any]], world: int) -> dict[int, tuple]:
    """``run_student_code``'s ``each``: every rank sent its own rows, as the last argument."""
    return {rank: (rows_of(batches, rank, world),) for rank in range(world)}


def loss(net: Any, x: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(net(x), y)


def flat(net: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def optimizer(kind: str, params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.Adam(params, lr=0.01)


def one_process(kind: str, batches: list[tuple[Any, Any]], scale: float = 1.0) -> Any:
    """The weights after a step of one process on each whole batch; gradients times ``scale``."""
    net = model()
    opt = optimizer(kind, net.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss(net, x, y).backward()
        for p in net.parameters():
            p.grad *= scale
        opt.step()
    return flat(net)


def verdict(exercise: str, kind: str, weights: list[Any], hint: str,
            batches: list[tuple[Any, Any]]) -> None:
    """Raise unless every rank's weights are one process's on ``batches``; name the mistake behind them.

    Compared here, in the checker, with its own torch: the ranks send their weights only. The
    mistakes, in the order they are tried: weights that match a known wrong scaling of the
    gradients (averaged twice, summed); weights off by float32's rounding only (a step computed
    in float32: named as that, never blamed on the method); ranks that disagree.
    """
    import torch

    world = len(weights)
    if not all(isinstance(w, torch.Tensor) and w.dtype == torch.float64 for w in weights) or \
            len({w.shape for w in weights}) != 1:
        raise Feedback(f"{exercise}: the model's parameters did not come back as one float64 "
                       f"tensor per rank.", hint=hint)
    expected = one_process(kind, batches)
    gaps = [float((w - expected).abs().max()) for w in weights]
    if max(gaps) <= TOLERANCE:
        return
    measured = (f"After {STEPS} steps the weights differ from one process training on the whole "
                f"batch in float64: " + ", ".join(f"rank {r} by {g:.3g}" for r, g in enumerate(gaps))
                + f" (tolerance {TOLERANCE:g}).")
    mistakes = {1 / world: "the gradients were averaged twice (divided by world_size twice)",
                world: "the gradients were summed but never divided by world_size (not averaged)"}
    for scale, mistake in mistakes.items():
        other = one_process(kind, batches, scale)
        if all(float((w - other).abs().max()) <= 1e-9 for w in weights):
            raise Feedback(f"{exercise}: {mistake}.", detail=[measured], hint=hint)
    if all(float32_rounding(expected, w) for w in weights):
        raise Feedback(f"{exercise}: the weights are one process's only to float32's rounding, not "
                       f"float64's: your code computes in float32 somewhere.",
                       detail=[measured], hint=FLOAT32_HINT)
    if any(not torch.equal(weights[0], w) for w in weights[1:]):
        raise Feedback(f"{exercise}: the ranks' weights do not even agree with each other: some rank "
                       f"stepped with gradients that were not (yet) everyone's.",
                       detail=[measured], hint=hint)
    raise Feedback(f"{exercise}: the weights are not one process's on the whole batch.",
                   detail=[measured], hint=hint)


class AllReduceLog:
    """On a rank: while active, every ``dist.all_reduce`` call is recorded in ``calls``.

    Each call: ``step``, ``numel``, ``async_op``, ``in_backward`` (made while
    ``backward()`` was running) and, for an async call, whether its handle's
    ``wait()`` (or ``get_future()``) was called before ``steps_taken``. Handles
    nobody waited for are waited for on exit, so the next check starts clean.
    """

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.works: list[tuple[dict, Any]] = []
        self.step = 0
        self.in_backward = False

    def __enter__(self) -> AllReduceLog:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        real = self.real = dist.all_reduce
        log = self

        class Handle:
            def __init__(self, work: Any, call: dict) -> None:
                self._work, self._call = work, call

            def wait(self, *args: Any, **kwargs: Any) -> Any:
                self._call["waited"] = True
                return self._work.wait(*args, **kwargs)

            def get_future(self) -> Any:
                self._call["waited"] = True
                return self._work.get_future()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._work, name)

        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            async_op = bool(kwargs.get("async_op", args[3] if len(args) > 3 else False))
            call = {"step": log.step, "numel": tensor.numel(), "async_op": async_op,
                    "in_backward": log.in_backward, "waited": not async_op}
            log.calls.append(call)
            work = real(tensor, *args, **kwargs)
            if not async_op or work is None:
                return work
            log.works.append((call, work))
            return Handle(work, call)

        dist.all_reduce = c10d.all_reduce = all_reduce
        return self

    def unwaited(self, step: int) -> int:
        """Async all_reduces of ``step`` whose handle was never waited for (so far)."""
        return sum(1 for call in self.calls if call["step"] == step and not call["waited"])

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        dist.all_reduce = c10d.all_reduce = self.real
        for _, work in self.works:
            work.wait()


def require_callables(call: str, **fns: Any) -> None:
    """Raise naming the argument of ``call`` that is not a function (or class)."""
    for name, fn in fns.items():
        if not callable(fn):
            raise Feedback(f"{call} needs your {name}, but got {fn!r}.",
                           hint="run the exercise cell above without errors and pass what it defines.")
