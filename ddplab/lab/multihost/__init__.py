"""A lab whose ranks run on other hosts: ``start(hosts=[...])``, ``engines="slurm"``/``"mpi"``, ``attach``.

- ``host_ranks``: ``HostRanks``, the ``Ranks`` of engines on other hosts, reached
  only through ipyparallel's controller: it places ranks on hosts
  (``ddplab.hosts``), forms their group at rank 0's TCPStore, watches the
  heartbeats and ends what it started.
- ``start``: how those engines come to exist when ddplab starts them:
  ``plan(...)`` checks the arguments and returns the ``HostEngines`` that
  start and stop the controller and the engines.
- ``ssh``: one ssh session per host, all at once, through ``ssh_cmd``.
- ``batch``: ipyparallel's Slurm and MPI launchers, watched so that a start
  that cannot succeed fails within seconds (``python -m ddplab.lab.multihost.batch``
  ends mpiexec when the kernel dies).

``ddplab.hosts`` (where each rank runs: node rank, local rank, global rank)
stays a top-level teaching module: notebooks 04 and 07 import it, and its
``describe_engine`` runs on the engines.
"""
