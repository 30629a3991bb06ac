"""Grading submitted notebooks (``ddplab grade``), one module per step.

The steps, in the order they run, as nbgrader's ``converters/autograde.py``
lists its preprocessors. ``STEPS`` is the list; this one says what each step
does, in the same order with the same modules (``tests/test_grade_steps.py``
holds it, and docs/contributing.md, to ``STEPS``):

0. hand-in, ``handin``: what was handed in, read as untrusted input: a link
   is never followed, what is not a regular file never opened, one graded
   copy per notebook per student (the newest; the others listed with it); a
   refused entry is still a row, with its reason. ``students``: whose each
   entry is (the folder that holds the notebooks; sections, nbgrader's
   layout, ``--student-depth``).
1. cells, ``cells``: find the reference's exercises and check cells, match
   the submission's cells to them by id, and list the ``CellRun``s to run
   (the reference's copy in place of each check cell, a deleted one put back).
2. run, ``run``: run the cells in a fresh Jupyter kernel through nbclient,
   in a worker process of its own, kept from the grader by an ``isolation``
   (a bubblewrap ``sandbox`` where the machine has one; else, as root, an
   ``unprivileged`` account); recover from hangs and crashes by replaying.
   A check cell the grader cannot run itself runs in the kernel under the
   ``guard``.
3. witness, ``witness``: the worker runs each check cell itself, against the
   submission's ranks, where the submission's code never ran (``unpickle``:
   what it loads from the submission's processes), through a ``Lab`` of its
   own attached to them (``ddplab.lab.attached``).
4. compare, ``compare``: each check cell's outputs against the reference's,
   the way nbval compares (``nbval_sanitize.cfg`` applied to both sides),
   and the score: one ``Mark`` per exercise. ``nbval_rules``: nbval's own
   rules for reading a notebook, without nbval (a student's install has none).
5. journal, ``journal``: every finished grade appended as it finishes
   (``--resume``); output paths checked first, files written atomically.
6. report, ``report``: the table, CSV, JUnit XML and Gradescope's results;
   ``gradebook``: Canvas's import (with a roster) and cells no spreadsheet runs.

``class_run`` (``DRIVER``) drives the whole class: a pool of workers, one per
submission, and ``grade()``, what the ``ddplab grade`` command calls. Nothing
here imports ``ddplab.course``.
"""

#: The grading steps in the order they run: (the step, the modules of ``ddplab.grade`` that do it).
STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hand-in", ("handin", "students")),
    ("cells", ("cells",)),
    ("run", ("run", "isolation", "sandbox", "unprivileged", "guard")),
    ("witness", ("witness", "unpickle")),
    ("compare", ("compare", "nbval_rules")),
    ("journal", ("journal",)),
    ("report", ("report", "gradebook")),
)
#: The module that drives the steps for a class; every other module of ``ddplab.grade`` is a step's.
DRIVER = "class_run"
