"""Checkers for notebook 03 (init methods and launchers); see _core for the shared behaviour.

    ddplab.check.tcp_group()                              # each rank joined one group over tcp://
    ddplab.check.store_barrier(store_barrier)             # run on the ranks, with a real TCPStore
    ddplab.check.global_rank(global_rank, two_nodes)      # against what torchrun really set
    ddplab.check.launcher_env(launcher_env, two_nodes)     # (the function runs on rank 0)
    ddplab.check.own_group_demo(all_reduce_demo)           # through lab.spawn, on the lab's ranks

The tables show expected values: they are the ranks' own state, or a
function's results for inputs the check chose (torchrun's numbering, a
barrier that returned or timed out), never a value the student writes down.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ._core import answers_of, checker, compare, passed, run_student_code, student_raised
from ._feedback import Feedback, ranks_phrase

log = logging.getLogger(__name__)

__all__ = ["global_rank", "launcher_env", "own_group_demo", "store_barrier", "tcp_group"]

#: The variables a launcher sets for every worker (the env:// contract).
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


#: What a barrier that hangs usually does wrong.
_BARRIER_HANG = ("a barrier whose ranks all wait on a key that no rank sets never returns: the last "
                 "rank to arrive (add returns world_size) must set the key the others wait for.")


# ------------------------------------------------------------------ tcp_group
def _group_state() -> dict:
    """On a rank: the state of its default group, as far as the exercise cares."""
    import os

    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        return {"joined": False}
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"joined": True, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "sum": t.item(),
            "env": sorted(k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
                          if k in os.environ)}


@checker
def tcp_group(lab: Any = None, timeout: float = 20) -> None:
    """Check that every rank of the lab joined one gloo group over ``tcp://``, with its own rank.

    Reads the default group's state on each rank: joined, rank (the prompt's
    rank), world size (the lab's), an all_reduce across it that works, and
    no MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE in the environment
    (those are env://'s way; tcp:// passes everything in the call).
    """
    n = lab.world_size
    states = run_student_code("the group check (one all_reduce)", _group_state, lab=lab,
                              timeout=timeout,
                              hint="some ranks are in a group the others are not in: every rank "
                                   "must join the same tcp:// address with the same world_size.")
    missing = [rank for rank, s in enumerate(states) if not s["joined"]]
    if missing:
        raise Feedback(
            f"{ranks_phrase(missing)} {'have' if len(missing) > 1 else 'has'} not joined a group "
            f"(dist.is_initialized() is False there).",
            hint=f"run that rank's prompt, with init_process_group('gloo', "
                 f"init_method=f'tcp://127.0.0.1:{{port}}', rank=..., world_size={n}).")
    compare("(rank, world_size) of the group", [(rank, n) for rank in range(n)],
            [(s["rank"], s["world_size"]) for s in states],
            hint=f"the prompt %%rank r passes rank=r, and every prompt passes world_size={n}.")
    total = float(sum(range(n)))
    compare("an all_reduce of the ranks in the group", [total] * n, [s["sum"] for s in states],
            hint="all ranks must join one group at the same tcp:// address.")
    compare("torchrun's variables set in the environment", [[]] * n, [s["env"] for s in states],
            hint="tcp:// needs no environment variables: the address is in the URL, and rank "
                 "and world_size are arguments. Do not set them (that is env://'s way).")
    passed(f"the {n} ranks joined one group over tcp://, each with its own rank.")


# ------------------------------------------------------------------ store_barrier
def _loopback_store(timeout_s: float):
    """A TCPStore server in this process, on a free port of 127.0.0.1 only; (store, port)."""
    import datetime
    import socket

    import torch.distributed as dist
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s),
                          master_listen_fd=listener.fileno())
    listener.detach()          # the store owns the socket now, and closes it when it goes
    return store, port


#: The check's TCPStore server, held on rank 0 between the rounds (see store_barrier).
_server_on_this_rank: Any = None


def _open_server(timeout_s: float) -> int:
    """On rank 0: start the check's store server and keep it; its port."""
    global _server_on_this_rank
    _server_on_this_rank, port = _loopback_store(timeout_s)
    return port


def _close_server() -> None:
    """On rank 0: stop listening now, not whenever the garbage collector runs."""
    global _server_on_this_rank
    _server_on_this_rank = None


def _barrier_round(fn: Callable, port: int, prefix: str, world_size: int, timeout_s: float) -> str:
    """On a rank: call the student's barrier on a fresh PrefixStore; say how it ended."""
    import datetime

    import torch.distributed as dist

    from ..rank.output import hide_fd_output
    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with hide_fd_output():       # the timeout round makes c10d log an error, by design
            fn(dist.PrefixStore(prefix, client), world_size)
        return "returned"
    except dist.DistStoreError as exc:
        return "timed out" if "timeout" in str(exc).lower() else f"raised DistStoreError: {exc}"
    except NotImplementedError:
        raise                        # the stub: the student's exception, by name and line
    except Exception as exc:  # noqa: BLE001 - any other failure is the student's, shown per rank
        return f"raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


@checker
def store_barrier(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(store, world_size)``, a barrier built from a store's add and wait.

    Round 1 and 2: every rank calls it (each round on a fresh PrefixStore of one
    TCPStore); all must return. Round 3: only rank 0 calls it, with a 3 s store
    timeout; a barrier must not return while a rank is missing, so the store's
    wait has to time out.
    """
    n = lab.world_size
    # The server lives on rank 0, as torchrun's agent lives beside its workers: the
    # ranks have a network of their own (ddplab.rank.netns), which the kernel is not on.
    port = lab.run(_open_server, 60, ranks=[0], timeout=60)[0]
    try:
        for round_ in (1, 2):
            got = run_student_code(f"store_barrier (round {round_})", _barrier_round, fn, port,
                                   f"check/round{round_}", n, 20.0, lab=lab, timeout=60,
                                   hint=_BARRIER_HANG)
            compare(f"store_barrier with all {n} ranks arriving (round {round_})",
                    ["returned"] * n, got,
                    hint="the last rank to arrive (add returns world_size) must set a key that "
                         "every rank waits for with store.wait([...]).")
        alone = run_student_code("store_barrier (rank 0 alone)", _barrier_round, fn, port,
                                 "check/alone", n, 3.0, lab=lab, timeout=60, ranks=[0],
                                 hint=_BARRIER_HANG)
        compare(f"store_barrier with only rank 0 of {n} arriving", ["timed out"], [alone[0]],
                hint="a barrier must not return until every rank has arrived: wait on a key "
                     "only the last arrival sets, so the store's timeout ends the wait.")
    finally:
        try:
            lab.run(_close_server, ranks=[0], timeout=60)
        except Exception:  # noqa: BLE001 - a broken lab ends the server anyway; keep the real error
            log.debug("could not stop the check's store server on rank 0", exc_info=True)
    passed(f"the barrier waits for all {n} ranks, and times out when one is missing.")


# ------------------------------------------------------- global_rank, launcher_env
def _workers(launch: Any) -> list[dict]:
    reports = getattr(launch, "reports", None)
    if not reports:
        raise Feedback("the launch has no reports: the two-node torchrun cell above has not run.",
                       hint="run it (two_nodes = launch.torchrun(...)) first, then this check.")
    return [reports[rank] for rank in sorted(reports)]


def _answers(name: str, fn: Callable, calls: list[tuple], lab: Any) -> list[Any]:
    """``fn(*args)`` for each call, on rank 0 (``answers_of``); the first exception fails the check."""
    answers = answers_of(fn, calls, lab)
    for args, answer in zip(calls, answers):
        if answer[0] != "ok":
            raise student_raised(f"{name}{tuple(args)!r}", answer)
    return [answer[1] for answer in answers]


@checker(needs_lab=False)
def global_rank(fn: Callable, launch: Any, lab: Any = None) -> None:
    """Check ``fn(node_rank, local_rank, nproc_per_node)`` against torchrun's own RANK.

    First against every worker of the real two-node launch, then against a
    3-node x 4-process layout numbered node by node, as torchrun numbers them.
    ``fn`` runs on rank 0 of the running lab (``answers_of``), or here if none runs.
    """
    workers = _workers(launch)
    expected = [int(w["RANK"]) for w in workers]
    layout = [(node, local) for node in range(3) for local in range(4)]
    calls = [(int(w["GROUP_RANK"]), int(w["LOCAL_RANK"]), int(w["LOCAL_WORLD_SIZE"]))
             for w in workers] + [(node, local, 4) for node, local in layout]
    got = _answers("global_rank", fn, calls, lab)
    hint = "all of node 0's processes come first, then node 1's, and so on."
    compare("global rank of torchrun's workers", expected, got[:len(workers)], hint=hint)
    compare("global rank in a 3-node x 4-process job", list(range(len(layout))),
            got[len(workers):], hint=hint)
    passed("global rank = node_rank * nproc_per_node + local_rank, as torchrun numbers them "
           "with its default, static rendezvous.")


@checker(needs_lab=False)
def launcher_env(fn: Callable, launch: Any, lab: Any = None) -> None:
    """Check ``fn(node_rank, local_rank, nnodes, nproc_per_node, master_addr, master_port)``,
    a dict of the env:// variables, against what torchrun gave each worker of the launch.
    ``fn`` runs on rank 0 of the running lab (``answers_of``), or here if none runs."""
    workers = _workers(launch)
    nnodes = len(launch.commands)
    expected = [{k: w[k] for k in ENV_KEYS} for w in workers]
    answers = _answers("launcher_env", fn, [
        (int(w["GROUP_RANK"]), int(w["LOCAL_RANK"]), nnodes, int(w["LOCAL_WORLD_SIZE"]),
         w["MASTER_ADDR"], int(w["MASTER_PORT"])) for w in workers], lab)
    got = [{k: answer.get(k, "<missing>") for k in ENV_KEYS} if isinstance(answer, dict) else answer
           for answer in answers]
    compare("the environment of torchrun's workers", expected, got,
            hint="environment variables are strings (str(...)); WORLD_SIZE counts the processes "
                 "of every node, LOCAL_WORLD_SIZE those of one node.")
    passed("your launcher sets the same env:// variables as torchrun on every worker.")


# ------------------------------------------------------------------ own_group_demo
def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


@checker
def own_group_demo(fn: Callable, lab: Any = None) -> None:
    """Check ``fn(rank, world_size)``, in the DDP tutorial's style, through ``lab.spawn``.

    It must make its own group (``lab.spawn`` set MASTER_ADDR and MASTER_PORT),
    all_reduce ``rank + 1`` and return the sum on every rank; the lab's own group
    must work afterwards.
    """
    __tracebackhide__ = True
    n = lab.world_size
    # A cap: a function that loops for ever keeps a rank busy, which a job's timeout calls
    # progress; the demo takes a second, so a check still ends.
    got = lab.spawn(fn, args=(n,), limit=2 * lab.spec.timeout)
    compare("what fn(rank, world_size) returned through lab.spawn", [float(n * (n + 1) // 2)] * n,
            [float(g) if isinstance(g, (int, float)) else g for g in got],
            hint="call dist.init_process_group('gloo', rank=rank, world_size=world_size) first, "
                 "all_reduce torch.tensor([rank + 1.0]), then destroy_process_group() and return "
                 "the tensor's .item().")
    compare("the lab's own group after lab.spawn (dist.get_world_size())", [n] * n,
            lab.run(_world_size))
    passed(f"lab.spawn ran your function on {n} ranks as mp.spawn would; they made their own "
           f"group, and the lab's group is back.")
