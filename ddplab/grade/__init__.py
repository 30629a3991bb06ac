"""Grading submitted notebooks (``ddplab grade``), one module per step.

The steps, in the order they run, as nbgrader's ``converters/autograde.py``
lists its preprocessors:

0. ``handin``: what was handed in, read as untrusted input: a link is never
   followed, what is not a regular file never opened, one graded copy per
   notebook per student (the newest; the others listed with it); a refused
   entry is still a row, with its reason. ``students``: whose each entry is
   (the folder that holds the notebooks; sections, nbgrader's layout,
   ``--student-depth``).
1. ``plan``: find the reference's exercises and check cells, match the
   submission's cells to them by id, and list the ``Step``s to run (the
   reference's copy in place of each check cell, a deleted one put back).
2. ``run``: run the steps in a fresh Jupyter kernel through nbclient, in a
   worker process of its own, inside a bubblewrap ``sandbox`` where the
   machine has one; recover from hangs and crashes by replaying. A check
   cell the grader cannot run itself runs in the kernel under the ``guard``.
3. ``witness``: the worker runs each check cell itself, against the
   submission's ranks, where the submission's code never ran (``unpickle``:
   what it loads from the submission's processes), through a ``Lab`` of its
   own attached to them (``ddplab.lab.attached``).
4. ``compare``: each check cell's outputs against the reference's, the way
   nbval compares (``nbval_sanitize.cfg`` applied to both sides).
5. score (``compare.score``): one ``Mark`` per exercise.
6. ``journal``: every finished grade appended as it finishes (``--resume``);
   output paths checked first, files written atomically.
7. ``report``: the table, CSV, JUnit XML and Gradescope's results;
   ``gradebook``: Canvas's import (with a roster) and cells no spreadsheet runs.

``class_run`` drives the whole class: a pool of workers, one per submission,
and ``grade()``, what the ``ddplab grade`` command calls. Nothing here imports
``ddplab.course``.
"""
