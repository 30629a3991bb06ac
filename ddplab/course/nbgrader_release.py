"""nbgrader's ``generate_assignment`` making ddplab's student version: the same outputs kept.

nbgrader's own student version clears every output (its ``ClearOutput``
step); ddplab's keeps a cell's outputs only where the student's own run of
that version prints them too (``ddplab.course.release``): a demo's picture
stays, a check's ``Correct: ...`` and anything computed from a solution go.
``StudentOutputs`` takes ``ClearOutput``'s place and applies ddplab's rule, cell
by cell, with the function ``ddplab release`` and ``ddplab notebooks`` use
(``release.student_cell``), so the three hand out the same notebook. In
``nbgrader_config.py``::

    c = get_config()
    from ddplab.course.nbgrader_release import PREPROCESSORS
    c.GenerateAssignment.preprocessors = PREPROCESSORS

The steps are named by their import paths, which nbconvert imports when it
registers them: ddplab itself never imports nbgrader, which it does not
depend on. ``tests/test_nbgrader.py`` checks that the list is nbgrader's own
with that one step replaced.
"""

from __future__ import annotations

from .release import student_cell

#: nbgrader's own ``generate_assignment`` steps (nbgrader 0.9's ``GenerateAssignment.preprocessors``).
NBGRADER_STEPS = ("IncludeHeaderFooter", "InstantiateTests", "LockCells", "ClearSolutions", "ClearOutput",
                  "CheckCellMetadata", "ComputeChecksums", "SaveCells", "ClearHiddenTests",
                  "ClearMarkScheme", "ComputeChecksums", "CheckCellMetadata")
#: Those steps by import path, ``ClearOutput`` replaced by ``StudentOutputs``.
PREPROCESSORS = [f"{__name__}.StudentOutputs" if step == "ClearOutput" else f"nbgrader.preprocessors.{step}"
                 for step in NBGRADER_STEPS]


class StudentOutputs:
    """ddplab's student outputs, as an nbconvert preprocessor (a callable on a notebook)."""

    enabled = True

    def __call__(self, nb, resources):
        for cell in nb.cells:
            student_cell(cell)
        return nb, resources
