"""Course tooling for instructors: release student copies, grade submissions.

- ``release``: swap every solution for nbgrader's stub.
- ``grade``: grade submissions (``grade_plan`` decides what runs, ``grade_run``
  runs it in a fresh kernel, ``report`` prints the table, CSV and JUnit XML).
- ``grade_witness``: the grading worker runs each check itself, out of the submission's
  reach (``grade_witness_lab``: its handle on the ranks; ``grade_unpickle``: what it
  loads from the submission's processes). ``grade_check``: the guard of a check cell
  that must run in the submission's kernel (forgeable).
- ``sandbox``: the bubblewrap sandbox each submission is graded in.
- ``outputs``: checked output paths, atomic writes, the journal behind ``--resume``.
- ``cli``: the ``ddplab`` command (``doctor``, ``release``, ``grade``).
- ``nbval_sanitize.cfg``: what nbval and ``grade`` blank out before comparing.
"""
