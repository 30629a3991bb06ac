"""Checkers for notebook 14, long sequences: the log-sum-exp merge, ring attention, Ulysses.

    ddplab.check.lse_merge(my_lse_merge)                  # two blocks' partial attention, merged
    ddplab.check.ring_attention(my_ring_attention)        # K/V round the ring, causal and not
    ddplab.check.ulysses(my_seq_to_heads, my_heads_to_seq) # all_to_all between the two shardings

Each compares with attention on one process (``ddplab.attention.full``) in
float64 at 1e-10, and says what went wrong by what it saw. ``lse_merge``: a merge
without the running max overflows on large scores; averaged outputs; a max for
the log-sum-exp. ``ring_attention`` (run causal and not, ``ddplab.check._ring``
watching): every collective raises; a product or a softmax over the whole
sequence is refused (keys or scores gathered, not merged); each rank must send
only to its right neighbour and receive only from its left, ``p - 1`` blocks;
the next block must be in flight while the current one is computed on; a causal
rank skips the blocks in its future; a wrong causal result is matched against
the usual mistakes (the mask not offset by the block's place, offset by one
block, the diagonal left out). ``ulysses``: only ``all_to_all`` may move data,
each element of the slice once (not the whole slice to every rank); the pieces
reshaped without moving the rank dimension are named. The inputs of
``ring_attention`` and ``ulysses`` are drawn for each check from a seed no rank
sees, each rank sent only its own slices (``Lab.run_each``), and the answers
are compared here: a rank can know another rank's slice only by communicating.
A wrong output is shown by its values against the reference (how many differ,
by how much, the first), never by its shape alone, and one off only by float32's
rounding is named as that mistake, never blamed on the merge. The hints name
what the merge must do, never its formula.
"""

from __future__ import annotations

from typing import Any, Callable

from .._core import (
    FLOAT32_HINT,
    answers_of,
    checker,
    passed,
    run_on_ranks,
    run_student_code,
    same,
    student_raised,
)
from .._feedback import Feedback, Row, float32_rounding, spell_against
from . import _ring

__all__ = ["lse_merge", "ring_attention", "ulysses"]

#: Seconds one call of a student's function may take before the ranks are reported as deadlocked.
TIMEOUT = 15.0
#: Seconds the check's own warm-up may take on fresh ranks of a loaded machine (imports, first products).
WARM_UP = 120.0
SEQ, HEADS, DIM = 24, 8, 5    # 8 heads: 2 a rank on 4 ranks, where a permute matters
ATOL = 1e-10
HANG_HINT = ("a ring where every rank first waits in recv (or in a blocking send) for its neighbour "
             "never moves. Post dist.isend to the right and dist.irecv from the left, compute, "
             "then wait() on both.")


def _need(fn: Any, name: str) -> None:
    if not callable(fn):
        raise Feedback(f"ddplab.check.{name} needs your function; got {fn!r}.",
                       hint=f"pass it, as in ddplab.check.{name}(my_{name}).")


# ----------------------------------------------------------------- the merge
def _merge_cases() -> list[tuple]:
    """(why, (out_a, lse_a, out_b, lse_b), (out, lse) of both blocks at once), computed on one process."""
    import torch

    from ddplab import attention

    q, k, v = attention.qkv(8, 2, 4, seed=11)
    cases = []
    for why, scale, mask in (("random blocks", 1.0, None), ("large scores", 1000.0, None),
                             ("a block with no visible key", 1.0, "causal")):
        qs = q * scale
        keep = torch.ones(8, 8, dtype=torch.bool).tril() if mask else None
        whole = attention.block(qs, k, v, keep)
        a = attention.block(qs, k[:, :4], v[:, :4], None if keep is None else keep[:, :4])
        b = attention.block(qs, k[:, 4:], v[:, 4:], None if keep is None else keep[:, 4:])
        cases.append((why, (*a, *b), whole))
    return cases


@checker(needs_lab=False)
def lse_merge(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)``: two blocks' attention merged exactly."""
    __tracebackhide__ = True
    import torch

    _need(fn, "lse_merge")
    cases = _merge_cases()
    answers = answers_of(fn, [args for _, args, _ in cases], lab)
    for (why, (oa, la, ob, lb), (out, lse)), answer in zip(cases, answers):
        what = f"lse_merge on {why}"
        if answer[0] != "ok":
            raise student_raised(what, answer)
        got = answer[1]
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and
                all(isinstance(t, torch.Tensor) for t in got)):
            raise Feedback(f"{what}: return a pair of tensors (out, lse); got {type(got).__name__}.")
        g_out, g_lse = got
        if same(out, g_out, ATOL) and same(lse, g_lse, ATOL):
            continue
        rows = [Row("out", spell_against(out, g_out), wrong=not same(out, g_out, ATOL)),
                Row("lse", spell_against(lse, g_lse), wrong=not same(lse, g_lse, ATOL))]
        if all(same(e, g, ATOL) or float32_rounding(e, g) for e, g in ((out, g_out), (lse, g_lse))):
            raise Feedback(f"{what}: the merged result is off only by float32's rounding: your code "
                           f"computes in float32 somewhere.", rows=rows, hint=FLOAT32_HINT)
        if not (torch.isfinite(g_out).all() and torch.isfinite(g_lse[torch.isfinite(lse)]).all()):
            mistake, hint = (("the merge overflowed or divided 0 by 0 (inf or nan): a merge without "
                              "the running max",
                              "exp of an lse overflows float64 beyond 709: take the larger of the "
                              "two lse out before exponentiating, and put it back after the log")
                             if why == "large scores" else
                             ("nan or inf: a block that saw no key has lse = -inf and carries no "
                              "weight", "the running max must be of both lse, not of one"))
        elif same((oa + ob) / 2, g_out, ATOL):
            mistake, hint = ("the two outputs were averaged",
                             "each block's output counts by the share of the softmax its keys hold, "
                             "which the two lse tell")
        elif same(torch.maximum(la, lb), g_lse, ATOL):
            mistake, hint = ("the merged lse is the larger of the two",
                             "the merged lse is the log-sum-exp over both blocks' scores together")
        else:
            mistake, hint = ("the merged result differs from attention over both blocks at once",
                             "the merged output is each block's output weighted by its share of "
                             "the softmax over both blocks; work out both shares on two blocks of "
                             "one key each")
        raise Feedback(f"{what}: {mistake} (compared with one process, float64, {ATOL:g}).",
                       rows=rows, hint=f"{hint}.")
    passed(f"lse_merge equals attention over both blocks at once on {len(cases)} cases, "
           f"large scores and masked rows included.")


# ----------------------------------------------------------------- the ring
def _reference(qkv: tuple, causal: bool, keep: Any = None) -> Any:
    """Attention over the whole sequence, or with the key mask ``keep`` (S x S) of a wrong answer."""
    from ddplab import attention

    q, k, v = qkv
    if keep is None:
        return attention.full(q, k, v, causal)
    return attention.block(q, k, v, keep)[0]


def _wrong_masks(p: int) -> dict[str, Any]:
    """The key masks of the usual causal mistakes, by the words that name them."""
    import torch

    b = SEQ // p
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    qb, kb = i // b, j // b
    return {
        "the mask was not offset by the block's place in the sequence: every block was masked as "
        "if it were the diagonal one (compare positions rank * block + i with source * block + j)":
            (kb <= qb) & (j % b <= i % b),
        "the same triangular mask on every block, not offset by the block's place in the sequence, "
        "and blocks in the future not skipped": j % b <= i % b,
        "the keys' offset is one block off (the block taken for the next rank's): the block that "
        "arrived at step t came from rank (rank - t) mod p": j + b <= i,
        "the keys' offset is one block off (the block taken for the previous rank's): the block "
        "that arrived at step t came from rank (rank - t) mod p": (j - b <= i) & (kb <= qb),
        "the diagonal was left out: a query attends its own position (key position <= query "
        "position)": j < i,
        "no causal mask at all": torch.ones(SEQ, SEQ, dtype=torch.bool),
    }


def _ring_messages(p: int, logs: list[list]) -> list[str]:
    """What in the logs a ring moving each block p - 1 times to the right would not do."""
    per_block = 2 * HEADS * (SEQ // p) * DIM        # the elements of one rank's K and V
    if p > 1 and not any(e[0] in ("send", "recv") for log in logs for e in log):
        return ["no dist.isend / dist.irecv could be seen: send the blocks through `dist.` "
                "(import torch.distributed as dist), so the check can follow them"]
    problems = []
    for rank, log in enumerate(logs):
        right, left = (rank + 1) % p, (rank - 1) % p
        for op, other, word in (("send", right, "sent to"), ("recv", left, "received from")):
            mine = [e for e in log if e[0] == op]
            wrong = sorted({e[1] for e in mine if e[1] != other}, key=str)
            if wrong:
                problems.append(f"rank {rank} {word} rank {', '.join(map(str, wrong))}; round the "
                                f"ring a rank {word} only rank {other}")
            moved = sum(e[2] for e in mine)
            if not wrong and moved != (p - 1) * per_block:
                problems.append(f"rank {rank} {'sent' if op == 'send' else 'received'} {moved} "
                                f"elements; the ring moves every other rank's keys and values once: "
                                f"p - 1 = {p - 1} block(s) of {per_block} (K and V)")
    return problems


def _zeroed(out: Any) -> Any:
    """A query that saw no key at all has output 0 in the wrong answers the check matches, not nan."""
    import torch

    return torch.nan_to_num(out, nan=0.0) if isinstance(out, torch.Tensor) else out


def _overlapped(log: list) -> bool:
    """Whether every irecv had some compute between its posting and its wait."""
    posted = {e[3]: n for n, e in enumerate(log) if e[0] == "recv"}
    waited = {e[1]: n for n, e in enumerate(log) if e[0] == "wait"}
    return all(any(e[0] == "compute" for e in log[start:waited.get(number, len(log))])
               for number, start in posted.items())


def _computes(log: list) -> int:
    return sum(1 for e in log if e[0] == "compute")


def _run_ring(fn: Callable, lab: Any, causal: bool, qkv: tuple) -> list[dict]:
    """``fn`` on every rank, each sent only its slices of ``qkv`` (``Lab.run_each``); results by rank."""
    __tracebackhide__ = True
    from ddplab import attention

    p = lab.world_size
    run_on_ranks(_ring.warm, lab=lab, timeout=WARM_UP)
    got = run_student_code(f"ring_attention(q, k, v, causal={causal})", _ring.ring_run, fn,
                           "ring_attention", causal, SEQ, lab=lab, timeout=TIMEOUT, hint=HANG_HINT,
                           each={rank: tuple(attention.shard(t, rank, p) for t in qkv)
                                 for rank in range(p)})
    return [got[rank] for rank in range(p)]


@checker
def ring_attention(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(q, k, v, causal)`` on every rank: ring attention equal to one process's."""
    __tracebackhide__ = True
    from ddplab import attention

    _need(fn, "ring_attention")
    p = lab.world_size
    qkv = _drawn()                     # one draw for both runs: causal and not compare on one input
    runs = {causal: _run_ring(fn, lab, causal, qkv) for causal in (False, True)}
    for got in runs.values():
        _ring.raise_refusal(got)
    for causal, got in runs.items():
        late = [rank for rank, g in enumerate(got) if g["unwaited"]]
        if late:
            raise Feedback(f"ring_attention: a missing wait on rank(s) {late}: a request dist.isend / "
                           f"dist.irecv returned was never waited on.",
                           hint="an irecv's block holds the message only after its wait().")
        problems = _ring_messages(p, [g["log"] for g in got])
        if problems:
            raise Feedback(f"ring_attention(causal={causal}): the messages are not a ring's.",
                           detail=[f"  {line}" for line in problems])
        expected = _reference(qkv, causal)
        for rank, g in enumerate(got):
            mine = attention.shard(expected, rank, p)
            if same(mine, g["out"], ATOL):
                continue
            said = (f"ring_attention(causal={causal}) on rank {rank} is not its rows of attention "
                    f"over the whole sequence (one process, float64, {ATOL:g})")
            rows = [Row(rank, spell_against(mine, g["out"]), wrong=True)]
            if float32_rounding(mine, g["out"]):
                raise Feedback(f"{said}, only by float32's rounding: your code computes in float32 "
                               f"somewhere.", rows=rows, hint=FLOAT32_HINT)
            why = next((words for words, keep in (_wrong_masks(p).items() if causal else ())
                        if same(attention.shard(_reference(qkv, True, keep), rank, p), _zeroed(g["out"]),
                                ATOL)),
                       "merge each block's (out, lse) into the running result with the "
                       "log-sum-exp weights; the queries stay, only K and V travel")
            raise Feedback(f"{said}.", rows=rows, hint=f"{why}.")
    if p > 1 and not all(_overlapped(g["log"]) for g in runs[False]):
        raise Feedback(
            "ring_attention: no overlap. Each block was waited for before any compute ran while it "
            "travelled.",
            hint="start the next block's transfer (isend to the right, irecv from the left) before "
                 "computing on the current block, and wait() on it after.")
    busy = [_computes(g["log"]) for g in runs[True]]
    if p > 1 and busy[0] >= _computes(runs[False][0]["log"]):
        raise Feedback(
            "ring_attention(causal=True): rank 0 computed on as many blocks as without the mask.",
            hint="a block whose keys all come after every one of the rank's queries (source rank > "
                 "rank) is masked out entirely: skip it (pass it on, compute nothing).")
    passed(f"ring_attention equals attention over the whole sequence, causal and not, on {p} "
           f"ranks (float64, {ATOL:g}): K/V went round the ring in p - 1 = {p - 1} step(s), each "
           f"in flight while a block was computed on, and future blocks were skipped.")


# ----------------------------------------------------------------- Ulysses
def _drawn() -> tuple[Any, Any, Any]:
    """Queries, keys and values of the check's shape from a seed drawn now, which no rank sees."""
    import secrets

    from ddplab import attention

    return attention.qkv(SEQ, HEADS, DIM, secrets.randbits(40))


def _unpermuted(pieces: list, p: int, shape: tuple) -> Any:
    """What rank r gets when the p pieces are put end to end with reshape, not permute."""
    import torch

    return torch.stack(pieces).reshape(shape)


@checker
def ulysses(to_heads: Callable, to_seq: Callable, lab: Any = None) -> None:
    """Check ``to_heads(x)``: (H, S/p, d) -> (H/p, S, d) by all_to_all, and ``to_seq`` back."""
    __tracebackhide__ = True
    from ddplab import attention

    _need(to_heads, "seq_to_heads")
    _need(to_seq, "heads_to_seq")
    p = lab.world_size
    run_on_ranks(_ring.warm, lab=lab, timeout=WARM_UP)
    # Drawn here for this check alone, each rank sent only its own slices: q, k, v, and the heads
    # of another tensor for heads_to_seq (so that no input is another's answer).
    (q, k, v), other = _drawn(), _drawn()[0]
    own = {rank: (*(attention.shard(t, rank, p) for t in (q, k, v)), attention.shard(other, rank, p, 0))
           for rank in range(p)}
    got = run_student_code("seq_to_heads / heads_to_seq", _ring.reshard_run, to_heads, to_seq,
                           "ulysses", lab=lab, timeout=TIMEOUT, each=own,
                           hint="every rank must call all_to_all the same number of times.")
    got = [got[rank] for rank in range(p)]
    _ring.raise_refusal(got)
    extra = [rank for rank, g in enumerate(got) if g["moved"] > g["slice"]]
    if extra:
        g = got[extra[0]]
        raise Feedback(
            f"seq_to_heads on rank {extra[0]} passed {g['moved']} elements to all_to_all to re-shard a "
            f"slice of {g['slice']}: more than the slice itself.",
            hint="a re-shard sends each element once, each rank its own heads (the piece for itself "
                 "included); sending the whole slice to every rank is an all_gather, p times the "
                 "bytes.")
    for rank, g in enumerate(got):
        heads = attention.shard(q, rank, p, 0)
        seq = attention.shard(other, rank, p)
        for name, expected, mine, given in (
                ("seq_to_heads", heads, g["heads"], "its sequence slice (H, S/p, d)"),
                ("heads_to_seq", seq, g["seq"], "its heads (H/p, S, d)")):
            if same(expected, mine, ATOL):
                continue
            said = f"{name} on rank {rank}, given {given}, is wrong (one process, {ATOL:g})"
            rows = [Row(rank, spell_against(expected, mine), wrong=True)]
            if float32_rounding(expected, mine):
                raise Feedback(f"{said}, only by float32's rounding: your code computes in float32 "
                               f"somewhere.", rows=rows, hint=FLOAT32_HINT)
            if name == "seq_to_heads":
                pieces = [attention.shard(attention.shard(q, j, p), rank, p, 0) for j in range(p)]
            else:
                pieces = [attention.shard(other, j, p, 0).reshape(p, HEADS // p, SEQ // p, DIM)[rank]
                          for j in range(p)]
            if same(_unpermuted(pieces, p, tuple(expected.shape)), mine, ATOL):
                why = ("the p pieces are in the right places as blocks, but were reshaped without "
                       "moving the rank dimension next to the one it splits: view the received "
                       "tensor as (p, H/p, S/p, d) and permute before merging the sequence "
                       "(or permute before sending, for heads_to_seq)")
            else:
                why = ("split the heads into p pieces, one for each rank; a rank receives its heads "
                       "of every rank's slice and puts them in rank order along the sequence")
            raise Feedback(f"{said}.", rows=rows, hint=f"{why}.")
    expected = attention.full(q, k, v, causal=True)
    wrong = [rank for rank, g in enumerate(got)
             if not same(attention.shard(expected, rank, p), g["attention"], ATOL)]
    if wrong:
        raise Feedback(f"Ulysses attention (to_seq(full(to_heads(q), ...))) is wrong on ranks "
                       f"{wrong}, though each re-shard is right alone.",
                       hint="each call must leave its input unchanged.")
    passed(f"seq_to_heads and heads_to_seq re-shard with all_to_all on {p} ranks, and Ulysses "
           f"attention between them equals one process's (causal, float64, {ATOL:g}).")
