"""Where a notebook starts its lab: ``start()`` picks one host or several.

``ddplab.start``, ``ddplab.attach`` and ``ddplab.current`` are these. The lab
itself is ``cluster.Lab`` (one host) or ``multihost.HostLab`` (several).
"""

from __future__ import annotations

from typing import Any

from ..env import check_fits, check_init_method, check_timeout, check_world_size, gpu_count
from ..errors import ConfigError
from . import cluster, display, magics, multihost
from .cluster import Lab, LabSpec, current
from .multihost import attach

__all__ = ["attach", "current", "start"]


def start(world_size: int = 2, backend: str = "auto", timeout: float = 60, *,
          grace: float = 2.0, pg_timeout: float = 1800, debug: bool = False,
          init_method: str | None = "store", hosts: Any = None, engines: str | None = None,
          **host_options: Any) -> Lab:
    """Start a lab of ``world_size`` ranks, or return the running one if it matches.

    - ``backend``: ``"auto"`` (nccl with one GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
    - ``timeout``: seconds any cell or ``lab.run`` may take before ``HangError``.
    - ``grace``: seconds a ``%%rank N`` cell waits before returning and leaving the rank running.
    - ``pg_timeout``: the process group's own timeout. Long by default, because
      in the two-prompt style a send may wait while a person reads the next cell.
    - ``debug``: set ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on the ranks, so a
      mismatched collective comes with torch's own explanation.
    - ``init_method``: how the ranks find each other in ``init_process_group``.
      Every rank gets torchrun's variables (RANK, WORLD_SIZE, ...) whichever you pick.

      - ``"store"`` (default): a rendezvous no other user of the machine can
        reach. The kernel makes a fresh, empty file (mode 0600) in the lab's
        private directory (mode 0700), every rank opens a ``FileStore`` on it
        and calls ``init_process_group(store=...)``. No port: nothing to collide
        on, and nothing on 127.0.0.1 that another user could connect to, list
        or write keys in (a TCPStore has no access control). MASTER_ADDR and
        MASTER_PORT are not set, since nobody listens. Each start and restart
        uses a new file (``store-N``); ``lab.stop()`` removes it with the
        directory. Multi-host labs keep a TCPStore: a file cannot span hosts.
      - ``"env"``: ``init_process_group(init_method="env://")``, as under
        torchrun: torch reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0
        opens the store on MASTER_PORT, chosen by ``ddplab.env.free_port()``.
      - ``"tcp"``: ``init_method="tcp://127.0.0.1:PORT"`` with ``rank`` and
        ``world_size`` passed in, a free port as for ``"env"``.
      - ``"file"``: ``init_method="file:///<fresh file in the lab's private
        directory>"``, a FileStore; no port at all, so MASTER_ADDR and
        MASTER_PORT are not set. Each start and restart uses a new file.

      - ``None``: bare ranks, as two Python prompts would be. Nothing of
        torch.distributed is initialised and torchrun's variables (RANK,
        MASTER_ADDR, MASTER_PORT, ...) are not set: the student calls
        ``init_process_group`` in ``%%rank`` / ``%%ranks`` cells. Each rank's
        namespace holds ``rank`` and ``world_size`` (its place in the lab),
        ``port`` (one port of 127.0.0.1 that was free at start, the same on
        every rank, new at each start and restart, so students sharing a
        machine never collide on 29500) and ``lab_dir`` (an empty folder in
        the lab's private directory, new at each restart and removed at stop:
        a place for ``file://`` files). A ``%%rank``
        cell whose rank waits there for the others says so at the grace period;
        one that never fills becomes a ``HangError`` saying why.

      With ``"env"`` and ``"tcp"`` torch binds the port a moment after ddplab
      found it free, so another program could take it first (then rank 0 fails
      to start its store), and torch's store listens on every interface, open
      to anyone who can reach it, as under torchrun.

      What still listens in a local lab, on 127.0.0.1 only, whichever you pick:

      - gloo's sockets between the ranks (a couple of ephemeral ports per
        rank; nccl's bootstrap sockets on a GPU machine likewise). Another
        user of this machine can connect to them, and gloo does not
        authenticate peers: it matches a new connection to a rank by a small
        sequence number. Stray bytes are dropped, but someone who speaks
        gloo's handshake and connects first while a group is forming (start,
        restart, ``new_group``) could stand in for a rank: feed it wrong
        tensors, or make it fail or hang (and the ``*_object`` collectives
        unpickle what they receive). Established connections cannot be
        taken over.
      - ipyparallel's controller ports: anyone may connect, but every message
        must be signed (HMAC-SHA256) with a key kept in the 0700 directory;
        unsigned ones are dropped.

      The lab's store and files are out of their reach. Where other users
      must not even see the ports, run the lab in a container or a VM of its own.

    - ``hosts=["node1", "node2"]`` or ``engines="ssh"|"mpi"|"slurm"``: ranks on
      several hosts, started by ipyparallel's launchers; see ``ddplab.lab.multihost``
      (its options, such as ``listen=`` or ``ssh_cmd=``, go in ``host_options``).

    Use it as ``with ddplab.start(...) as lab:`` to stop the lab at the end.
    """
    if hosts is not None or engines is not None or host_options:
        if init_method != "store":
            raise ConfigError(
                f"ddplab: init_method={init_method!r} is for a lab on this machine; a lab on "
                f"several hosts always joins its ranks at rank 0's TCPStore (see "
                f"ddplab.lab.multihost). Use start(hosts=...) without init_method, or "
                f"start(world_size=..., init_method={init_method!r}) for local ranks.")
        return multihost.start_hosts(world_size, backend, timeout, hosts=hosts, engines=engines,
                                     grace=grace, pg_timeout=pg_timeout, debug=debug,
                                     **host_options)
    spec = LabSpec(world_size=check_world_size(world_size), backend=backend,
                   timeout=check_timeout(timeout), grace=check_timeout(grace, "grace", example=2),
                   pg_timeout=check_timeout(pg_timeout, "pg_timeout"), debug=bool(debug),
                   init_method=check_init_method(init_method))
    gpus = gpu_count() if spec.backend in ("auto", "nccl") else 0
    lab = Lab(spec, gpus)                  # validates the backend before anything starts
    running = cluster.current_or_none()
    if running is not None and running.running and running.spec == spec:
        return running
    warning = check_fits(spec.world_size)      # refuses what memory cannot hold
    if warning:
        display.say(warning)
    cluster.stop_current()                 # the engine template stays warm for the new lab
    lab.start()
    cluster.make_current(lab)
    display.say(f"ddplab: {spec.world_size} ranks ready, backend {lab.backend_reason}.")
    magics.register()
    return lab
