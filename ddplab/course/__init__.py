"""Course tooling for instructors: the notebooks, their student copies, the ``ddplab`` command.

- ``notebooks``: the course notebooks shipped with ddplab, copied out for a student.
- ``release``: swap every solution for nbgrader's stub.
- ``mysteries``: notebook 09's buggy programs (``ddplab.check.mystery(kind)``), course content
  the notebook runs and its checkers run variants of.
- ``cli``: the ``ddplab`` command (``doctor``, ``release``, ``grade``); ``grade``
  calls down into ``ddplab.grade``, which never imports this package.
"""
