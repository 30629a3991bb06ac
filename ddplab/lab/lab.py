"""``Lab``: the running group of ranks a notebook drives. Make one with ``ddplab.start``.

The lab's lifecycle and failure modes are described in ``ddplab.lab`` (the
package docstring). A ``Lab`` is composed of two parts and never subclassed:

- a ``Ranks`` (``ddplab.lab.ranks``): the processes, on this machine
  (``LocalRanks``), on several hosts (``HostRanks``), or another's lab
  attached to (``AttachedRanks``, the grader's);
- a ``Calls`` (``ddplab.lab.calls``): what was sent to the ranks and how it ended.

``Lab`` itself checks arguments, keeps the lab's lifecycle (start, restart,
stop, the exit handler) and returns results by rank.
"""

from __future__ import annotations

import atexit
import contextlib
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

from ..env import check_timeout
from ..errors import ConfigError
from ..rank import engine
from . import current_lab, owncode, shipping, template
from .calls import Calls, Task
from .local import LocalRanks
from .ranks import Joins, LabSpec, Ranks

__all__ = ["Lab", "LabSpec", "Task"]


class Lab:
    """A running group of ranks. Make one with ``ddplab.start`` (or ``ddplab.attach``).

    ``Lab(spec, gpus)`` runs the ranks on this machine; ``Lab(spec, engines=...)``
    runs them wherever that ``Ranks`` puts them.
    """

    def __init__(self, spec: LabSpec, gpus: int = 0, *, engines: Ranks | None = None) -> None:
        self.spec = spec
        self._engines: Ranks = LocalRanks(spec, gpus) if engines is None else engines
        self._calls = Calls(self._engines, bare=spec.init_method is None)
        self._attached = False         # inside lab.debugpy(): calls wait without the lab's timeout

    # ------------------------------------------------------------- state
    @property
    def world_size(self) -> int:
        return self._engines.world_size

    @property
    def ranks(self) -> list[int]:
        """The torch ranks, ``[0, 1, ..., world_size - 1]``."""
        return list(range(self.world_size))

    @property
    def backend(self) -> str:
        return self._engines.backend

    @property
    def backend_reason(self) -> str:
        """The backend and why it was chosen, e.g. ``"gloo (no GPU here)"``."""
        return self._engines.backend_reason

    @property
    def running(self) -> bool:
        return self._engines.running

    @property
    def pids(self) -> list[int]:
        """The engine process ids, indexed by rank (for tests and tools, not for output)."""
        return self._engines.pids

    @property
    def directory(self) -> str:
        """The lab's owner-only (0700) directory: connection files, store, stack files.
        ``""`` once stopped (it is removed)."""
        return self._engines.directory

    @property
    def controller_pid(self) -> int | None:
        """The pid of the ipyparallel controller this lab started here, if it did."""
        return self._engines.controller_pid

    @property
    def hosts(self) -> list[dict]:
        """One entry per host, in node-rank order: ``node_rank``, ``address``, ``hostname``, ``ranks``."""
        return self._engines.hosts

    @property
    def store_path(self) -> str:
        """The file of the default rendezvous' FileStore, in the lab's 0700 directory: the
        latest group's (``""`` before any, and on multi-host labs); removed by ``stop()``."""
        return getattr(self._engines, "store_path", "")

    @property
    def engines(self) -> Ranks:
        """The processes of the ranks: a ``LocalRanks``, ``HostRanks`` or ``AttachedRanks``
        (for tools and tests)."""
        return self._engines

    @property
    def calls(self) -> Calls:
        """What the lab sent to its ranks (for tools and tests: ``lab.calls.submit`` sends
        without waiting)."""
        return self._calls

    @property
    def broken_reason(self) -> str:
        """Why this lab needs ``restart()`` (a hang, a rank stuck after a failure, a lost
        engine), or ``""`` while it is usable or stopped."""
        return self._calls.broken_reason()

    @property
    def healthy(self) -> bool:
        """Whether the lab is running and usable: every rank alive, none stuck."""
        return self.running and not self.broken_reason

    def describe(self) -> str:
        """One line: how many ranks, where, which backend (what ``start`` prints)."""
        return self._engines.describe()

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "Lab":
        """Start this lab's processes and form the group (``ddplab.start`` does it). Returns the lab."""
        # A script that ends without lab.stop() must not leave processes or files
        # behind; _teardown unregisters this again, so restarts do not pile them up.
        atexit.register(self._teardown)
        try:
            self._form(self._engines.bring_up())
            self._engines.formed()
        except BaseException:
            self._teardown()
            raise
        if self.spec.world_size != self._engines.world_size:    # attach: every engine there
            self.spec = replace(self.spec, world_size=self._engines.world_size)
        self._exit_first()
        self._calls.forget()
        return self

    def _exit_first(self) -> None:
        """Make this lab's teardown the first exit handler to run (atexit runs the last
        registered first).

        A kernel that is shut down (Kernel > Shut down) gets about 2.5 s to exit
        before Jupyter sends SIGTERM, then SIGKILL. Handlers registered while the lab
        came up (the engine template's) wait up to 5 s for stuck engines to act on
        SIGTERM; run before ours, they used up that time, the kernel was killed
        between ending the controller (whose guard removes the directory when the
        kernel dies) and removing the directory itself, and the directory stayed.
        Our teardown kills stuck engines at once (``grace=0``), then the rest.
        """
        atexit.unregister(self._teardown)
        atexit.register(self._teardown)

    def _teardown(self) -> None:
        """End every process this lab started and remove its files (even if ending one failed)."""
        try:
            self._engines.shut_down()
        finally:
            self._calls.forget()
            atexit.unregister(self._teardown)

    def stop(self, *, keep_warm: bool = False) -> None:
        """End every engine and the controller, and remove the lab's files.

        It also ends the kernel's engine template (``ddplab.lab.template``) unless
        another lab is running (or ``keep_warm``, as when ``start()`` replaces one
        lab by another): after ``lab.stop()`` nothing ddplab started is left running.
        """
        self._teardown()
        current_lab.forget(self)
        if not keep_warm:
            template.stop_if_unused()

    def restart(self) -> "Lab":
        """Replace every engine with a fresh one; ranks stay 0..N-1. Returns the lab.

        After ``lab.stop()`` this starts the lab again, and it becomes the
        current lab (what ``%%ranks`` and ``ddplab.start()`` find) unless
        another lab is running as the current one by then.
        """
        if self.running:
            self._calls.forget()
            try:
                joins = self._engines.replace()
                if joins is not None:
                    self._form(joins)
                    self._exit_first()       # a template started anew registered its own handler
                    self._calls.forget()
                    return self
            except BaseException:
                self._teardown()
                raise
        self._teardown()
        self.start()
        current_lab.offer(self)
        return self

    def _form(self, joins: Joins) -> None:
        """Form the group: each rank's ``join_group``, sent and waited for as any call, so a
        rank that fails or hangs while joining is reported like a cell's."""
        if joins:
            tasks = [self._calls.call(rank, engine.call, engine.join_group, args, {})
                     for rank, args in sorted(joins.items())]
            self._calls.await_join(tasks, self.spec.timeout)

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        hosts = self.hosts
        where = "" if len(hosts) < 2 else " hosts=[" + ", ".join(
            f"{h['address']}: ranks {h['ranks']}" for h in hosts) + "]"
        return f"<ddplab.Lab world_size={self.world_size} backend={self.backend!r} {state}{where}>"

    # ------------------------------------------------------------- running
    def check_ranks(self, ranks: Iterable[int] | int | None, spelled: str | None = None) -> list[int]:
        """The ranks to run on, sorted; ConfigError naming the fix if any is not a rank here.

        ``spelled`` is how the user wrote them (``"%%rank 5"``), for the message.
        """
        if ranks is None:
            return self.ranks
        chosen = [ranks] if isinstance(ranks, int) else list(ranks)
        spelled = spelled or f"ranks={ranks!r}"
        n = self.world_size
        if not chosen:
            raise ConfigError(f"ddplab: {spelled} names no rank. Name at least one of this "
                              f"lab's ranks, 0..{n - 1}.")
        bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < n]
        if bad:
            more = max((r for r in bad if isinstance(r, int) and not isinstance(r, bool)
                        and r >= n), default=None)
            bigger = f"ddplab.start(world_size={more + 1})" if more is not None else \
                "ddplab.start(world_size=...)"
            raise ConfigError(
                f"ddplab: {spelled} names rank {bad[0]!r}, but this lab has ranks 0..{n - 1} "
                f"(world_size={n}). Use one of those, or {bigger} for more.")
        return sorted(set(chosen))

    def ensure_usable(self) -> None:
        """Raise ``DdplabError`` saying how to recover if the lab is stopped or broken."""
        self._calls.ensure_usable()

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return float("inf") if self._attached else self.spec.timeout
        return check_timeout(timeout)

    @staticmethod
    def _limit(limit: float | None) -> float | None:
        return None if limit is None else check_timeout(limit, "limit", example=3600)

    def run(self, fn: Callable, *args: Any, ranks: Iterable[int] | None = None,
            timeout: float | None = None, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` on every rank (or on ``ranks``) and return the results.

        Returns a list indexed by rank; with ``ranks=`` given, a dict keyed by rank.
        What the ranks print is shown afterwards, grouped by rank, in rank order.
        Raises ``RankError`` if any rank raised, ``HangError`` after ``timeout``.
        """
        if not callable(fn):
            raise ConfigError(f"ddplab: lab.run needs a function to call on the ranks, but got "
                              f"{fn!r} ({type(fn).__name__}). Use lab.run(my_function, *args).")
        chosen = self.check_ranks(ranks)
        timeout = self._timeout(timeout)
        self.ensure_usable()
        if any(isinstance(a, Lab) for a in (*args, *kwargs.values())):
            raise ConfigError("ddplab: lab.run was given the lab itself as an argument; the lab lives "
                              "in the notebook and cannot travel to the ranks. On a rank, use "
                              "torch.distributed (dist.get_rank(), dist.get_world_size()) instead.")
        pickled = shipping.pack("lab.run", fn, args, kwargs)
        tasks = self._calls.submit(chosen, engine.call_pickled, pickled, (), owncode.sources(fn),
                                   shipping.kernel_path())
        self._calls.finish(tasks, timeout, grace=None)
        values = {task.rank: task.outcome["value"] for task in tasks}
        return [values[r] for r in self.ranks] if ranks is None else values

    def run_each(self, fn: Callable, own: dict[int, tuple], *common: Any,
                 timeout: float | None = None) -> dict[int, Any]:
        """Call ``fn(*common, *own[r])`` on each rank ``r`` of ``own``, at once; results keyed by rank.

        Each rank is sent only its own arguments ``own[r]`` (``lab.run`` sends every
        rank the same): a checker hands each rank its own input, which the other
        ranks can learn only by communicating. ``fn`` and ``common`` are pickled
        once for all. Raises as ``lab.run`` does.
        """
        if not callable(fn):
            raise ConfigError(f"ddplab: lab.run_each needs a function to call on the ranks, but got "
                              f"{fn!r} ({type(fn).__name__}).")
        chosen = self.check_ranks(list(own))
        timeout = self._timeout(timeout)
        self.ensure_usable()
        pickled, path = shipping.pack("lab.run_each", fn, common), shipping.kernel_path()
        tasks = [task for rank in chosen
                 for task in self._calls.submit([rank], engine.call_pickled, pickled, tuple(own[rank]),
                                                owncode.sources(fn), path)]
        self._calls.finish(tasks, timeout, grace=None)
        return {task.rank: task.outcome["value"] for task in tasks}

    def run_cell(self, source: str, ranks: Iterable[int] | None = None,
                 timeout: float | None = None, grace: float | None = None,
                 pdb: bool = False) -> None:
        """Run notebook-cell source on ranks; what ``%%ranks`` and ``%%rank`` call.

        With ``grace``, return once that many seconds pass with ranks still
        running, leaving them running (the two-prompt style). ``pdb``: each
        rank stops in the debugger at the cell's first line (``--pdb``).
        """
        chosen = self.check_ranks(ranks)
        timeout = self._timeout(timeout)
        grace = None if grace is None else check_timeout(grace, "grace", example=2)
        self.ensure_usable()
        tasks = self._calls.submit(chosen, engine.run_cell, source, pdb, shipping.kernel_path())
        self._calls.finish(tasks, timeout, grace)

    def debug(self, rank: int | None = None, timeout: float | None = None) -> None:
        """Post-mortem pdb on the rank that raised the last ``RankError``, like IPython's ``%debug``.

        Its prompt, ``(Pdb rank 1)``, opens in the notebook, in that rank's frames
        where the error was raised: ``p x``, ``u``, ``d``, ``l``; ``c`` or ``q`` leave.
        ``rank`` picks another rank that failed. ``%ddplab_debug`` calls this.
        """
        from . import debugger
        if rank is not None:
            self.check_ranks(rank, f"lab.debug(rank={rank!r})")
        debugger.post_mortem(self._calls, rank, self._timeout(timeout))

    def debugpy(self, ranks: Iterable[int] | int | None = None,
                folder: str = ".") -> contextlib.AbstractContextManager[None]:
        """VS Code attached to ``ranks``: ``with lab.debugpy(ranks=[1]): lab.run(fn)``.

        The ranks listen with debugpy, reached on this machine's 127.0.0.1 only,
        at the ports printed and written to ``folder/.vscode/launch.json``
        (``ddplab: attach to ranks``). Entering waits until VS Code attached;
        inside, calls wait without the lab's timeout; after, nothing listens.
        ``%%rank 1 --debugpy`` is one cell in such a block. ``ranks=1`` is rank 1.
        Called without ``with``, it does nothing, and says so with the fix.
        ``ddplab.lab.debugpy_attach`` says how.
        """
        from .debugpy_attach import Block
        spelled = f"lab.debugpy(ranks={ranks!r})"
        chosen = self.check_ranks(ranks, spelled)
        return Block(self._debugpy(chosen, folder), spelled, chosen)

    @contextlib.contextmanager
    def _debugpy(self, chosen: list[int], folder: str) -> Iterator[None]:
        from .debugpy_attach import Session
        self.ensure_usable()
        with Session(self._calls, chosen, getattr(self._engines, "network_shared_because", None),
                     folder):
            self._attached = True
            try:
                yield
            finally:
                self._attached = False

    def trace(self, ranks: Iterable[int] | None = None, align: str = "auto") -> Any:
        """Record what the ranks' torch.distributed calls do: ``with lab.trace() as tr:``.

        ``tr`` then draws one lane per rank; see ``ddplab.trace``.
        """
        from ..trace import Trace
        return Trace(self, ranks, align)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for cells still running from earlier ``%%rank`` cells and show their output."""
        timeout = self._timeout(timeout)
        self.ensure_usable()
        # Waited for on purpose: their failures are this call's, and raise.
        self._calls.wait_pending(timeout)

    # ------------------------------------------------------------- code with its own group
    def spawn(self, fn: Callable, args: tuple = (), timeout: float | None = None, *,
              nprocs: int | None = None, join: bool = True,
              limit: float | None = None) -> list[Any]:
        """Call ``fn(rank, *args)`` on every rank, as ``torch.multiprocessing.spawn`` would.

        For code that makes its own process group (``init_process_group`` ...
        ``destroy_process_group``), like the DDP tutorial's ``demo_basic``: the lab's
        group is set aside while it runs and is back afterwards. Returns the results,
        a list indexed by rank. ``nprocs`` (if given) must be the lab's world_size.

        ``timeout`` is a no-progress timeout: a job that computes, or whose collectives
        move, runs on past it; ``HangError`` once no rank made progress for a whole
        ``timeout`` (``ddplab.lab.stall``). ``limit`` (seconds): the job's whole time at most.
        """
        return owncode.spawn(self._calls, fn, args, self._timeout(timeout), nprocs=nprocs,
                             join=join, limit=self._limit(limit))

    def run_script(self, path: str, *argv: Any, timeout: float | None = None,
                   limit: float | None = None) -> None:
        """Run a Python script as ``__main__`` on every rank, as ``torchrun`` would.

        Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``) and ``sys.argv = [path,
        *argv]``; the lab's group is set aside while it runs. Output comes back by rank;
        the script's globals stay in each rank's namespace (``%%ranks`` can look at them).
        ``timeout`` and ``limit`` as for ``spawn``: a script that makes progress runs on.
        """
        owncode.run_script(self._calls, path, argv, self._timeout(timeout), self._limit(limit))
