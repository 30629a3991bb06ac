"""On a rank, for notebook 14's attention checks: run the student's function and watch how it works.

``ring_run`` calls ``fn(q, k, v, causal)`` on this rank's slice of the sequence
and notes, in order, every ``isend``/``irecv`` (peer, elements), every ``wait()``
on their requests and every matrix product (``@``, ``matmul``, ``einsum``, ...,
seen through a ``TorchFunctionMode``): from that log the checker tells whether
the key/value blocks went round the ring, whether the next block was in flight
while the current one was computed on, and whether causal blocks in the future
were skipped. A product whose operand spans the whole sequence is refused on the
spot: attention over gathered keys, not the ring. Every collective raises.

``reshard_run`` calls the Ulysses re-shards with only ``all_to_all`` allowed.
"""

from __future__ import annotations

from typing import Any, Callable

from .._feedback import Feedback, ranks_phrase
from .._forbid import COLLECTIVES, forbidding
from .._peers import peer, swap_peer_calls

#: Matrix products: the attention's compute, as a TorchFunctionMode sees it.
PRODUCTS = frozenset(("matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "einsum", "baddbmm",
                      "scaled_dot_product_attention", "tensordot"))
#: What normalises scores: over a last dimension as long as the sequence, scores gathered, not merged.
NORMALISERS = frozenset(("softmax", "log_softmax", "logsumexp", "exp", "exp_"))


class _Request:
    """A request isend/irecv returned; its ``wait()`` goes into the log."""

    def __init__(self, work: Any, number: int, log: list) -> None:
        self.work, self.number, self.log, self.waited = work, number, log, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not self.waited:
            self.log.append(("wait", self.number))
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def refused(call: Callable) -> tuple[Any, dict | None]:
    """On a rank: ``(call(), None)``, or ``(None, the refusal as data)`` if the check refused it.

    The check's refusals (a forbidden collective, a product over the whole
    sequence, split sizes that disagree) raise a ``Feedback`` inside the
    student's code; caught here, the checker fails with it once, naming the
    ranks, rather than with a traceback per rank, and the rank still reaches the
    check's closing barrier. What the student's own code raises goes on.
    """
    try:
        return call(), None
    except Feedback as refusal:
        return None, refusal.as_dict()


def raise_refusal(got: list[dict]) -> None:
    """In the kernel: fail with the first refusal, naming every rank that had it."""
    __tracebackhide__ = True
    said = {rank: g["refused"] for rank, g in enumerate(got) if isinstance(g, dict) and g.get("refused")}
    if said:
        first = Feedback.from_dict(next(iter(said.values())))
        ranks = [rank for rank, refusal in said.items() if refusal["headline"] == first.headline]
        raise Feedback(f"{first.headline.rstrip('.')}, on {ranks_phrase(ranks)}.", rows=first.rows,
                       detail=first.detail, hint=first.hint)


def _products(log: list, seq: int, exercise: str):
    """A TorchFunctionMode that logs each matrix product and refuses one over the whole sequence."""
    from torch.overrides import TorchFunctionMode

    class Products(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            __tracebackhide__ = True
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name in NORMALISERS and any(getattr(a, "ndim", 0) >= 2 and a.shape[-1] == seq
                                           for a in (*args, *kwargs.values())):
                raise Feedback(
                    f"{exercise}: a {name} over scores as long as the whole sequence ({seq}): the "
                    f"blocks' scores were put together, not merged.",
                    hint="compute each block's (out, lse) and merge it into the running result "
                         "with the log-sum-exp merge.")
            if name in PRODUCTS:
                shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if hasattr(a, "shape")]
                if any(len(s) >= 2 and seq in s[-2:] for s in shapes):
                    raise Feedback(
                        f"{exercise}: a product over the whole sequence ({func.__name__} of shapes "
                        f"{', '.join(map(str, shapes))}; the sequence is {seq} long): attention over "
                        f"gathered keys, not the ring.",
                        hint="each rank computes on one block of keys at a time, the block that has "
                             "just arrived, and merges.")
                log.append(("compute",))
            return func(*args, **kwargs)
    return Products()


def warm() -> None:
    """On a rank: import and run once what the checks use, before the student's timeout starts.

    A fresh rank on a loaded machine takes seconds over its first TorchFunctionMode,
    expert or refusal; the check's deadlock timeout is for the student's code.
    """
    import torch.distributed as dist

    from ddplab import attention, moe

    q, k, v = attention.qkv(8, 2, 4)
    with forbidding(COLLECTIVES, "warm-up", "nothing"), _products([], 9, "warm-up"):
        attention.block(q, k, v)
    moe.experts(2, 6)[0](moe.tokens(2, 6))
    dist.barrier()


def ring_run(fn: Callable, exercise: str, causal: bool, seq: int, q: Any, k: Any, v: Any) -> dict:
    """On a rank: ``fn`` on this rank's slice, its output and the log of messages and products.

    ``q``, ``k``, ``v`` are this rank's slices of a sequence ``seq`` long, drawn by the
    checker from a seed no rank sees and sent to this rank alone; the checker
    compares the output in its own process.
    """
    import torch
    import torch.distributed as dist

    log: list = []
    requests: list[_Request] = []
    depth = [0]

    def wrap(name: str, keyword: str, real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return real(*args, **kwargs)
            tensor = args[0] if args else kwargs.get("tensor")
            number = len(requests)
            log.append(("send" if "send" in name else "recv", peer(args, kwargs, keyword),
                        int(tensor.numel()) if hasattr(tensor, "numel") else -1, number))
            depth[0] += 1
            try:
                work = real(*args, **kwargs)
            finally:
                depth[0] -= 1
            request = _Request(work, number, log)
            requests.append(request)
            if not name.startswith("i"):          # a blocking call waited before it returned
                request.wait()
                return work
            return request
        return call

    undo = swap_peer_calls(wrap)
    try:
        with forbidding(COLLECTIVES, exercise, "ring attention"), _products(log, seq, exercise):
            out, said = refused(lambda: fn(q, k, v, causal))
    finally:
        undo()
    unwaited = [n for n, r in enumerate(requests) if not r.waited]
    for request in requests:
        if not request.waited and not said:     # a refused rank's peers may never send: no wait
            request.work.wait()
    dist.barrier()
    return {"out": out.detach().clone() if isinstance(out, torch.Tensor) else out,
            "log": log, "unwaited": unwaited, "refused": said}


def reshard_run(to_heads: Callable, to_seq: Callable, exercise: str, q: Any, k: Any, v: Any,
                heads: Any) -> dict:
    """On a rank: the two re-shards on this rank's inputs, and Ulysses attention made of them.

    ``q``, ``k``, ``v`` are this rank's sequence slices and ``heads`` its heads of
    another tensor (for ``to_seq`` alone), all drawn by the checker from seeds no
    rank sees and sent to this rank alone: what the answers should be is known
    only to the checker, which compares them in its own process.
    """
    import torch
    import torch.distributed as dist

    from ddplab import attention

    def refuse(name: str, keyword: str, real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise Feedback(f"{exercise}: dist.{name} moves one tensor to one rank, not a re-shard.",
                           hint="a Ulysses re-shard is one dist.all_to_all (or all_to_all_single), "
                                "every rank sending a piece to every rank.")
        return call

    def clone(t: Any) -> Any:
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    undo = swap_peer_calls(refuse)
    moved = [0]
    restore = _counting_all_to_all(moved)
    others = tuple(c for c in COLLECTIVES if c != "all_to_all")
    try:
        with forbidding(others, exercise, "a Ulysses re-shard"):
            def both() -> tuple:
                first = clone(to_heads(q.clone()))
                elements = moved[0]
                whole = [to_heads(t.clone()) for t in (q, k, v)]
                return (first, elements, clone(to_seq(heads.clone())),
                        clone(to_seq(attention.full(*whole, causal=True))))
            answers, said = refused(both)
    finally:
        restore()
        undo()
    dist.barrier()
    heads_of_q, elements, back, causal = answers or (None, 0, None, None)
    return {"heads": heads_of_q, "seq": back, "attention": causal, "refused": said,
            "moved": elements, "slice": q.numel()}


def _counting_all_to_all(moved: list) -> Callable[[], None]:
    """Count the elements passed to ``all_to_all``/``all_to_all_single`` into ``moved[0]``; the undo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = {(m, n): getattr(m, n) for m in (dist, c10d) for n in ("all_to_all", "all_to_all_single")}

    def counting(real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            given = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor_list"))
            pieces = given if isinstance(given, (list, tuple)) else [given]
            moved[0] += sum(int(t.numel()) for t in pieces if hasattr(t, "numel"))
            return real(*args, **kwargs)
        return call

    for name in ("all_to_all", "all_to_all_single"):
        replacement = counting(saved[(dist, name)])      # one object in both modules, as torch has
        for module in (dist, c10d):
            setattr(module, name, replacement)

    def undo() -> None:
        for (module, name), real in saved.items():
            setattr(module, name, real)
    return undo
