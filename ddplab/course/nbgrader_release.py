"""nbgrader's ``generate_assignment`` making ddplab's student version: the same outputs kept.

nbgrader's own student version clears every output (its ``ClearOutput``
step); ddplab's keeps a cell's outputs only where the student's own run of
that version prints them too (``ddplab.course.release``): a demo's picture
stays, a check's ``Correct: ...`` and anything computed from a solution go.
``StudentOutputs`` takes ``ClearOutput``'s place and applies ddplab's rule, cell
by cell, with the same function ``ddplab release`` and ``ddplab notebooks``
use (``release.student_cell``), so the three hand out the same notebook. In
``nbgrader_config.py``::

    c = get_config()
    from ddplab.course.nbgrader_release import PREPROCESSORS
    c.GenerateAssignment.preprocessors = PREPROCESSORS

Only nbgrader imports this module (it needs nbgrader, which ddplab does not).
"""

from __future__ import annotations

from nbgrader.converters import GenerateAssignment
from nbgrader.preprocessors import ClearOutput, NbGraderPreprocessor

from .release import student_cell


class StudentOutputs(NbGraderPreprocessor):
    """ddplab's student outputs in place of nbgrader's ``ClearOutput`` (which clears them all)."""

    def preprocess_cell(self, cell, resources, index):
        student_cell(cell)
        return cell, resources


#: nbgrader's ``generate_assignment`` steps, ``ClearOutput`` replaced by ``StudentOutputs``.
PREPROCESSORS = [StudentOutputs if step is ClearOutput else step
                 for step in GenerateAssignment.class_traits()["preprocessors"].default()]
