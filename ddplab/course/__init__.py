"""Course tooling for instructors: release student copies, grade submissions.

- ``release``: swap every solution for nbgrader's stub.
- ``grade``: grade submissions (``grade_plan`` decides what runs, ``grade_run``
  runs it in a fresh kernel, ``report`` prints the table, CSV and JUnit XML).
- ``grade_check``: how a check cell runs, so a submission cannot forge its verdict.
- ``sandbox``: the bubblewrap sandbox each submission is graded in.
- ``outputs``: checked output paths, atomic writes, the journal behind ``--resume``.
- ``cli``: the ``ddplab`` command (``doctor``, ``release``, ``grade``).
- ``nbval_sanitize.cfg``: what nbval and ``grade`` blank out before comparing.
"""
