"""The Lab: a torch.distributed process group you drive from a notebook.

Lifecycle
---------
``lab = ddplab.start(world_size=2)`` starts, through ipyparallel's Cluster API,
one controller and one engine process per rank on this machine: the controller
on Unix sockets in the lab's owner-only directory, the engines in a network of
their own (``ddplab.rank.netns``), out of other users' reach. Each engine
gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, OMP_NUM_THREADS; MASTER_ADDR and MASTER_PORT where a store
listens) and calls ``init_process_group``: by default through a FileStore in the
lab's owner-only directory, which no other user of the machine can reach;
``start(init_method="env" | "tcp" | "file")`` uses torch's own ``env://``,
``tcp://`` or ``file://`` instead. ddplab numbers the
ranks itself, 0..N-1, and every result and every line of output is keyed and
ordered by that rank.

- ``start(init_method=None)`` starts bare ranks: no group, no torchrun
  variables; the student calls ``init_process_group`` in ``%%rank`` cells (a
  free ``port``, ``rank``, ``world_size`` and ``lab_dir`` wait in each rank's
  namespace). After that, everything works as on a lab that joined by itself.
- ``start()`` with the same arguments returns the running lab; with other
  arguments it stops the old lab and starts a new one.
- ``lab.run(fn, ...)`` calls a function on the ranks; ``%%ranks`` and
  ``%%rank N`` run a cell there. Each rank keeps its namespace across cells.
- ``with lab.trace() as tr:`` (or ``%%ranks --trace``) records what the ranks'
  torch.distributed calls did and draws it as a timeline; see ``ddplab.trace``.
- ``lab.restart()`` replaces every engine (same ranks, fresh processes).
- ``lab.stop()``, or leaving ``with ddplab.start(...) as lab:``, ends every
  process the lab started and removes its files.

Failure modes, and what you see
-------------------------------
- Code raises on a rank: ``RankError`` with that rank's traceback.
- Ranks wait for each other forever (a deadlock): after ``timeout`` seconds,
  ``HangError`` says per rank whether it finished, failed or is still running,
  and where a stuck rank is blocked, e.g. ``rank 0: still in send (cell line 3)``.
  The stuck engines cannot be freed from inside; ``lab.restart()`` recovers.
  Sending a result back is not counted. For jobs (``lab.spawn``,
  ``lab.run_script``) ``timeout`` is a no-progress timeout: a long job that
  computes or communicates runs on (``ddplab.lab.stall``), but a rank that
  waited a whole timeout in one call ends it. A rank that returned while the
  others wait in a call is said at once, in a cell or a job.
- A ``%%rank N`` cell that is still running after ``grace`` seconds (a send
  waiting for its recv) returns at once and keeps running on its rank; its
  output appears under the next ddplab cell that finishes, or ``lab.wait()``.
- Bare ranks waiting in ``init_process_group`` for the others: a ``%%rank``
  cell returns after ``grace`` saying so; a group that never fills (a wrong
  world_size or port, a rank that never joins) becomes a ``HangError`` that
  says what that usually means.
- An engine dies (kill -9, out of memory): the next call raises
  ``EngineDiedError`` naming the rank; ``lab.restart()`` recovers.
- Kernel > Interrupt: the ranks get SIGINT. If they stop, the lab is usable;
  if one is blocked in C++ and cannot stop, the message says to restart.
- The kernel dies, even by kill -9: every engine and the controller notice
  their parent is gone and exit within about a second (``ddplab.rank.guard``);
  the controller's guard removes the lab's directory, and so does the engine
  template, for a kernel killed halfway through its own exit.
- Kernel > Shut down, even with ranks stuck: the lab's exit handler runs first
  (ipyparallel's is off), kills stuck engines at once and removes the directory,
  well within the 2.5 s Jupyter waits before it sends SIGTERM.

Where things are
----------------
- ``session``: ``start()`` (one host or several) and ``attach()``; each makes the lab current.
- ``lab``: ``Lab``, the API a notebook calls, composed of a ``Ranks`` and a ``Calls``.
- ``ranks``: the ``Ranks`` interface (the processes of the ranks, wherever they run),
  ``LabSpec`` and the heartbeat setting; ``local``: ``LocalRanks``, engines on this
  machine; ``hosts``: ``HostRanks``, engines on several hosts (``hosts.ranks``), and
  starting and stopping those engines (``hosts.launch``, with ``hosts.ssh`` and ``hosts.batch``).
- ``attached``: ``AttachedRanks``, the live engines of a lab another process started,
  never started, stopped or regrouped; ``attach`` makes a ``Lab`` over them (the grader's).
- ``owncode``: ``lab.spawn`` and ``lab.run_script``, for code that makes its own group.
- ``calls``: calls sent to the ranks and how they ended (results, errors, hangs,
  cells left running, late output, interrupts); ``fanout``: one call to many engines.
- ``bars``: the progress bars (``ProgressBars``) a wait shows; ``channel``: what the ranks
  publish while a call runs (progress, live screens, debugger requests), read one way.
- ``current_lab``: the lab ``current()``, ``%%ranks`` and the checkers use.
- ``magics``: the ``%%ranks`` / ``%%rank N`` cell magics.
- ``template``: engines forked from a warm process that imported torch once.
- ``display``: rank-ordered output in the notebook; ``live``: output while a cell runs.
- ``diagnose``: where a stuck rank is blocked, from its stack, and why an engine died;
  ``flight``: which collective each rank is in (torch's flight recorder), for ``HangError``;
  ``stall``: whether a call past its timeout is stuck, or a long job still making progress.

Every process a lab starts is ended by ``ddplab.procs``.

The code that runs inside each engine is in ``ddplab.rank``.
"""

from .current_lab import current
from .lab import Lab
from .ranks import LabSpec
from .session import attach, start

__all__ = ["Lab", "LabSpec", "attach", "current", "start"]
