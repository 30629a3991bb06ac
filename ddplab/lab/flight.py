"""Which collective each rank is in, and whether the ranks disagree: for ``HangError``.

Each local rank answers through ``ddplab.rank.flight`` (torch's flight
recorder, read by a thread of the rank even while its main thread is stuck).
From those summaries this module writes, per rank, the collective it is in or
finished last on each group (``collective #3`` counts from 1 the collectives
issued on that group), and one plain verdict:

- the same collective number with different ops or sizes: a mismatch, not a
  slow rank (``ranks disagree at collective #3: all_gather on rank 0,
  all_reduce on rank 1``);
- a rank waiting in collective #N that another rank never reached, and that
  rank has moved past it (it returned, or waits in another call): it called
  fewer collectives (one skipped behind an ``if rank == ...``, or a loop with
  fewer steps);
- the same, but that rank is still in its own code (``site``: asleep, in a
  ``queue.get``, a ``subprocess.run``, computing): it is late, not past the
  call, and the verdict says where it is and that it may simply be slow.

Each rank also says the send, recv or broadcast its main thread is in, with its
peer and tag (``ddplab.rank.flight.current_call``); ``call_hint`` names two
mistakes no stack shows: a send and its recv with different tags, and a
broadcast whose ``src`` differs between ranks (``src=rank``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from ..text import plural


def ask(requests: dict[int, tuple[str, str]], deadline: float,
        question: bytes = b"?") -> dict[int, Any]:
    """Ask each rank (its FIFO and answer file) a question; the answers of those that answered.

    ``b"?"``: its flight recorder summary; ``b"T"``: what its running trace recorded so far
    (the answer file is then the one ``ddplab.rank.flight.QUESTIONS`` names).
    """
    asked = {}
    for rank, (fifo, answer) in requests.items():
        with contextlib.suppress(OSError):
            os.remove(answer)
        try:
            # Non-blocking: a rank whose thread is not listening (a dead or bare
            # engine) makes this fail at once (ENXIO) instead of hanging the kernel.
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, question)
        finally:
            os.close(fd)
        asked[rank] = answer
    answers: dict[int, Any] = {}
    while asked and time.monotonic() < deadline:
        for rank, answer in list(asked.items()):
            try:
                with open(answer) as f:
                    answers[rank] = json.load(f)
                del asked[rank]
            except (OSError, ValueError):
                pass              # not written yet (it is renamed into place when complete)
        if asked:
            time.sleep(0.02)
    return answers


def _describe(record: dict) -> str:
    sizes = record["sizes"][0] if len(record["sizes"]) == 1 else record["sizes"]
    return f"collective #{record['seq']} {record['op']} {sizes}"


def site(records: list[dict]) -> dict:
    """Where a rank's answer says it is in its own code (``ddplab.rank.flight.current_site``);
    ``{}`` when the answer has none (an older rank, or none answered)."""
    return next((r["site"] for r in records if "site" in r), {})


def collectives_only(records: list[dict]) -> list[dict]:
    """A rank's answer without its call and its site: what its collectives did."""
    return [r for r in records if "group" in r]


def refine(line: str, records: list[dict]) -> str:
    """A rank's where-line from its stack (``in <module> (cell line 6)``, ``in select``), said
    exactly where the rank says its stack hides it (``hidden``): ``in Work.wait (cell line 6)``
    for a handle's ``wait()``, ``in asyncio.tasks.sleep (cell line 3)`` for an ``await``."""
    where = site(records)
    if where.get("hidden") and where.get("at") and where.get("inside"):
        return f"in {where['inside']} ({where['at']})"
    return line


def late_at(where: dict) -> str:
    """A site in words: ``at slow line 5 (`time.sleep(8)`)``, ``, inside queue.get`` after it."""
    text = f"at {where['at']}" if where.get("at") else "at a line of its own"
    if where.get("source"):
        text += f" (`{where['source']}`)"
    if where.get("inside"):
        text += f", inside {where['inside']}"
    return text


def _latest(records: list[dict]) -> dict[str, dict]:
    """Per group, the record that says where the rank is: the active one, else the last."""
    out: dict[str, dict] = {}
    for record in records:
        current = out.get(record["group"])
        if current is None or record["seq"] >= current["seq"]:
            out[record["group"]] = record
    return out


def report(answers: dict[int, list[dict]], busy: list[int] = (),
           timeout: float | None = None) -> list[str]:
    """Lines for ``HangError``: each rank's collectives, then the verdict (if there is one).

    A rank behind the others is said to have skipped a collective only if it moved past it:
    it returned, or waits in another call. One still in its own code (its answer's ``site``)
    is late, and the verdict says where (``timeout``: the one to raise). ``busy``: ranks known
    to run their own code where no site was read (``diagnose.busy_in_own_code``).
    """
    latest = {rank: _latest(collectives_only(records)) for rank, records in sorted(answers.items())}
    own = {rank: site(records) for rank, records in answers.items() if site(records).get("own")}
    groups = sorted({group for per_rank in latest.values() for group in per_rank})
    if not any(r["active"] for per_rank in latest.values() for r in per_rank.values()):
        return []             # nobody waits in a collective (a send/recv deadlock, a join)
    lines = ["Collectives, from torch's flight recorder (#N counts the collectives issued on "
             "a group, from 1):"]
    for rank, per_group in latest.items():
        parts = [("in " if r["active"] else "finished ") + _describe(r) + f" on {group}"
                 for group, r in sorted(per_group.items())]
        lines.append(f"  rank {rank}: " + ("; ".join(parts) or "no collective yet"))
    verdicts = [v for group in groups if (v := _verdict(group, latest, set(busy), own, timeout))]
    return lines + verdicts[:1]


def _verdict(group: str, latest: dict[int, dict[str, dict]], busy: set[int],
             own: dict[int, dict], timeout: float | None) -> str:
    on = {rank: per[group] for rank, per in latest.items() if group in per}
    # A member with no record issued none: every rank is in the default group; the members of
    # another are in its records (an older rank's have none: only those that recorded count).
    members = set(latest) if group == "the default group" else \
        {m for r in on.values() for m in r.get("members", ())} & set(latest)
    on.update({rank: {"seq": 0, "active": False, "op": "", "sizes": []}
               for rank in members if rank not in on})
    waiting = {rank: r for rank, r in on.items() if r["active"]}
    if not waiting:
        return ""
    seq = max(r["seq"] for r in waiting.values())
    at_seq = {rank: r for rank, r in on.items() if r["seq"] == seq}
    kinds = {(r["op"], json.dumps(r["sizes"])) for r in at_seq.values()}
    if len(kinds) > 1:
        calls = ", ".join(f"{r['op']} {r['sizes'][0] if len(r['sizes']) == 1 else r['sizes']} "
                          f"on rank {rank}" for rank, r in sorted(at_seq.items()))
        return (f"ddplab: the ranks disagree at collective #{seq} on {group}: {calls}: a "
                f"mismatch, not a slow rank. Every rank must call the same collectives in "
                f"the same order, with tensors of the same shape.")
    behind = sorted(rank for rank, r in on.items() if r["seq"] < seq)
    if not behind:
        return ""
    op = next(iter(at_seq.values()))["op"]
    ahead = sorted(waiting)
    head = (f"ddplab: {plural(len(ahead), 'rank')} {_names(ahead)} "
            f"{'waits' if len(ahead) == 1 else 'wait'} in collective #{seq} ({op}) on {group}, which")
    late = [rank for rank in behind if rank in own]
    past = [rank for rank in behind if rank not in own]
    if not late and set(past) <= busy:       # no site read: the stack said "busy"
        one = len(past) == 1
        return (f"{head} {plural(len(past), 'rank')} {_names(past)} {'has' if one else 'have'} "
                f"not reached yet: {'it is' if one else 'they are'} still running "
                f"{'its' if one else 'their'} own code. A slow rank reaches it later (pass a "
                f"longer timeout=); one that skips it (behind an `if rank == ...`, or in fewer "
                f"loop steps) never does.")
    parts = []
    if past:
        one = len(past) == 1
        parts.append(f"{plural(len(past), 'rank')} {_names(past)} never reached: "
                     f"{'it' if one else 'they'} issued fewer collectives (one skipped behind an "
                     f"`if rank == ...`, or fewer loop steps).")
    if late:
        parts.append(late_verdict(late, own, timeout))
    return f"{head} " + (parts[0] if len(parts) == 1 else f"{parts[0]} And {parts[1]}")


def late_verdict(late: list[int], own: dict[int, dict], timeout: float | None) -> str:
    """What a verdict says of ranks behind that are still in their own code: late, where, and
    the two ways on (``own``: each rank's site)."""
    one = len(late) == 1
    where = (late_at(own[late[0]]) if one else
             "; ".join(f"rank {rank} {late_at(own[rank])}" for rank in late))
    longer = f"more than {timeout:g} s" if timeout else "a longer one"
    return (f"{plural(len(late), 'rank')} {_names(late)} {'has' if one else 'have'} not reached "
            f"yet: {'it is' if one else 'they are'} still running {'its' if one else 'their'} "
            f"own code, {where}, not a torch.distributed call. {'It is' if one else 'They are'} "
            f"late, not past the call, and may simply be slow: pass a longer timeout= "
            f"({longer}), or look at what keeps {'it' if one else 'them'} there.")


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _peer(args: dict, *names: str) -> int | None:
    return next((args[name] for name in names if name in args), None)


def call_hint(answers: dict[int, list[dict]]) -> str:
    """A hint from the arguments of the calls the ranks wait in ("" when no mistake shows).

    ``dst``/``src`` are global ranks; ``group_dst``/``group_src`` stand in where the code
    named only those (the same numbers on the default group, where these mistakes are made).
    """
    calls = {rank: call for rank, records in answers.items()
             if (call := next((r for r in records if "call" in r), None))}
    sends = {rank: c["args"] for rank, c in calls.items() if c["call"] in ("send", "isend")}
    recvs = {rank: c["args"] for rank, c in calls.items() if c["call"] in ("recv", "irecv")}
    for rank, args in sorted(sends.items()):
        dst = _peer(args, "dst", "group_dst")
        got = recvs.get(dst)
        if got is None or _peer(got, "src", "group_src") not in (rank, None):
            continue
        if got.get("tag", 0) != args.get("tag", 0):
            return (f"Hint: rank {rank} sends to rank {dst} with tag={args.get('tag', 0)}, and "
                    f"rank {dst} waits in recv from rank {rank} with tag={got.get('tag', 0)}: a "
                    f"recv takes only a message sent with its own tag, so the two never meet. "
                    f"Give both sides the same tag (or leave tag out on both: it is 0).")
    sources = {rank: _peer(c["args"], "src", "group_src") for rank, c in calls.items()
               if c["call"] == "broadcast"}
    if len(sources) > 1 and len(set(sources.values())) > 1:
        named = ", ".join(f"src={src} on rank {rank}" for rank, src in sorted(sources.items()))
        own = all(src == rank for rank, src in sources.items())
        return (f"Hint: the ranks name different sources in broadcast: {named}. src is the one "
                f"rank whose tensor every rank receives, so it must be the same number on every "
                f"rank" + (" (src=rank, or src=dist.get_rank(), makes each rank its own source: "
                           "write src=0, or the rank that holds the data)." if own else "."))
    return ""
