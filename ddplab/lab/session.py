"""Where a notebook starts its lab: ``start()`` on this machine or on several hosts,
``attach()`` to engines you started.

``ddplab.start`` and ``ddplab.attach`` are these. Each builds a ``Lab``
(``ddplab.lab.lab``) from the right ``Ranks`` and makes it the current lab
in one step (``_adopt``): the lab it replaces stops, the new one starts, says
where its ranks are, and the ``%%ranks`` magics are registered.
"""

from __future__ import annotations

import difflib
import os
import time
from typing import Any

from ..env import check_fits, check_world_size, gpu_count
from ..errors import ConfigError
from . import current_lab, display, magics
from .lab import Lab
from .multihost import start as hoststart
from .multihost.host_ranks import HostRanks
from .ranks import LabSpec

__all__ = ["attach", "start"]


def _adopt(lab: Lab) -> Lab:
    """Make ``lab`` the current lab: stop the one it replaces, start it, say where it runs."""
    running = current_lab.current_or_none()
    if running is not None:
        running.stop(keep_warm=True)      # the engine template stays warm for the new lab
    lab.start()
    current_lab.make_current(lab)
    display.say(f"ddplab: {lab.describe()}")
    magics.register()
    return lab


def start(world_size: int = 2, backend: str = "auto", timeout: float = 60, *,
          grace: float = 2.0, pg_timeout: float = 1800, debug: bool = False,
          init_method: str | None = "store", hosts: Any = None, engines: str | None = None,
          start_timeout: float | None = None, **host_options: Any) -> Lab:
    """Start a lab of ``world_size`` ranks, or return the running one if it matches.

    - ``backend``: ``"auto"`` (nccl with one GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
    - ``timeout``: seconds any cell or ``lab.run`` may take before ``HangError``.
    - ``start_timeout``: seconds the start (and each ``lab.restart()``) may take: the
      engines registering, and the ranks forming their group. Default: a minute, or
      ``timeout`` if longer (``ddplab.lab.LabSpec``).
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

      Whichever you pick, nothing of a local lab is reachable by another user
      of this machine: the controller talks over Unix sockets in the lab's
      0700 directory, and the ranks live in a network namespace of their own
      (``ddplab.rank.netns``), so gloo's sockets and any TCPStore listen on a
      127.0.0.1 that only the ranks share. Where the machine forbids that
      (no user namespaces), the lab starts anyway and says in one line what
      is exposed: gloo's sockets on this machine's 127.0.0.1, where gloo does
      not authenticate who connects (docs/security.md, "What is exposed").

    - ``hosts=["node1", "node2"]`` or ``engines="ssh"|"mpi"|"slurm"``: ranks on
      several hosts, started by ipyparallel's launchers; see ``ddplab.lab.multihost``
      (its options, such as ``listen=`` or ``ssh_cmd=``, go in ``host_options``).

    Use it as ``with ddplab.start(...) as lab:`` to stop the lab at the end.
    """
    from ..rank.engine import in_lab
    if in_lab():
        # A lab inside a rank is owned by no notebook: its engines and its private folder
        # (the store, the keys) would outlive the lab that ran the cell.
        raise ConfigError("ddplab.start() ran on a rank (in a %%ranks/%%rank cell or lab.run): a "
                          "lab is started from the notebook's own cells, not from its ranks. Run "
                          "ddplab.start() in a plain cell; the ranks already are a lab.")
    unknown = sorted(set(host_options) - set(HOST_OPTIONS))
    if unknown:
        # A misspelt keyword (wrld=3) would otherwise reach _start_hosts as a raw TypeError.
        known = ("world_size", "backend", "timeout", "grace", "pg_timeout", "debug",
                 "init_method", "start_timeout", "hosts", "engines") + HOST_OPTIONS
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.5)
        raise ConfigError(f"ddplab.start() got an unknown keyword {unknown[0]}="
                          + (f": did you mean {close[0]}=?" if close else ".")
                          + f" It takes: {', '.join(known)}.")
    if hosts is not None or engines is not None or host_options:
        if init_method != "store":
            raise ConfigError(
                f"ddplab: init_method={init_method!r} is for a lab on this machine; a lab on "
                f"several hosts always joins its ranks at rank 0's TCPStore (see "
                f"ddplab.lab.multihost). Use start(hosts=...) without init_method, or "
                f"start(world_size=..., init_method={init_method!r}) for local ranks.")
        return _start_hosts(world_size, backend, timeout, hosts=hosts, engines=engines,
                            grace=grace, pg_timeout=pg_timeout, debug=debug,
                            start_timeout=start_timeout, **host_options)
    spec = LabSpec.build(world_size, backend, timeout, grace=grace, pg_timeout=pg_timeout,
                         debug=debug, init_method=init_method, start_timeout=start_timeout)
    gpus = gpu_count() if spec.backend in ("auto", "nccl") else 0
    lab = Lab(spec, gpus)                  # validates the backend before anything starts
    running = current_lab.current_or_none()
    if running is not None and running.running and running.spec == spec:
        return running
    warning = check_fits(spec.world_size)      # refuses what memory cannot hold
    if warning:
        display.say(warning)
    return _adopt(lab)


#: The keywords of a lab on several hosts that ``start`` passes on (``**host_options``).
HOST_OPTIONS = ("listen", "ssh_cmd", "remote_python", "config")


def _start_hosts(world_size: int, backend: str = "auto", timeout: float = 60, *,
                 hosts: Any = None, engines: str | None = None, listen: str | None = None,
                 ssh_cmd: list[str] | None = None, remote_python: str | None = None,
                 config: dict | None = None, grace: float = 2.0, pg_timeout: float = 1800,
                 debug: bool = False, start_timeout: float | None = None) -> Lab:
    """``ddplab.start(..., hosts=[...])`` / ``engines=``: see ``ddplab.lab.multihost``.

    - ``hosts``: hostnames (``user@host:port`` works), ranks split evenly, or
      ``{"host": ranks}``. Implies ``engines="ssh"``.
    - ``engines``: ``"ssh"``, ``"mpi"`` or ``"slurm"``: ipyparallel's launcher.
    - ``listen``: the address our controller listens on; by default the one
      this machine uses to reach the first host (for mpi/slurm: all
      interfaces, ``"*"``, since the compute nodes are not known in advance).
    - ``ssh_cmd``: the ssh command, ``["ssh", "-i", "key"]`` for example.
    - ``config``: more launcher settings, ``{"SlurmEngineSetLauncher": {"account": "x"}}``.
    """
    n = check_world_size(world_size)
    launch, order = hoststart.plan(n, hosts=hosts, engines=engines, listen=listen,
                                    ssh_cmd=ssh_cmd, remote_python=remote_python, config=config)
    spec = LabSpec.build(n, backend, timeout, grace=grace, pg_timeout=pg_timeout, debug=debug,
                         start_timeout=start_timeout)
    return _adopt(Lab(spec, engines=HostRanks(spec, launch=launch, host_order=order)))


def attach(url_file: str | None = None, *, profile: str | None = None,
           profile_dir: str | None = None, cluster_id: str | None = None,
           world_size: int | None = None, backend: str = "auto", timeout: float = 60,
           hosts_order: list[str] = (), grace: float = 2.0, pg_timeout: float = 1800,
           debug: bool = False, start_timeout: float | None = None) -> Lab:
    """Join a cluster you started (``ipcluster start``, a Slurm job) and form the group over it.

    Give the controller's ``ipcontroller-client.json`` (``url_file``), or a
    ``profile`` and ``cluster_id`` as you gave ``ipcluster``. ``world_size``
    defaults to every engine registered. Your engines keep running after
    ``lab.stop()``; they only leave the process group. ``start_timeout``: how long to wait
    for the controller's file and the engines, and for the group to form (``ddplab.start``).
    """
    spec = LabSpec.build(world_size, backend, timeout, grace=grace, pg_timeout=pg_timeout,
                         debug=debug, start_timeout=start_timeout)
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"ddplab: backend={backend!r} is not one ddplab knows. "
                          f"Use one of 'auto', 'gloo', 'nccl'.")

    def connect() -> Any:
        import ipyparallel as ipp
        if url_file is not None:
            # A job script may attach while its controller is still writing the file.
            deadline = time.monotonic() + spec.start_timeout
            while not os.path.exists(url_file) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not os.path.exists(url_file):
                raise ConfigError(f"ddplab: no connection file at {url_file} after "
                                  f"{spec.start_timeout:g} s. Start the controller first (ipcluster "
                                  f"start / ipcontroller) and give its ipcontroller-client.json.")
            return ipp.Client(url_file)
        kwargs = {k: v for k, v in (("profile", profile), ("profile_dir", profile_dir),
                                    ("cluster_id", cluster_id)) if v is not None}
        return ipp.Client(timeout=spec.start_timeout, **kwargs)

    order = [hoststart.address(h) for h in hosts_order]
    return _adopt(Lab(spec, engines=HostRanks(spec, connect=connect, host_order=order)))
