"""The reason a grading worker ended by a signal is given (issue 42): the submission killed its
grader, not the kernel's last log line. tests/test_grade_hostile.py grades the real attack."""

from __future__ import annotations

import signal

from ddplab.grade.class_run import killed_reason


def test_a_worker_killed_under_the_sandbox_or_without_says_the_submission_killed_it():
    for returncode, sandboxed in ((128 + signal.SIGKILL, True), (-signal.SIGKILL, False)):
        reason = killed_reason(returncode, sandboxed)
        assert reason.startswith("not graded: the submission killed its grader: the grading "
                                 "worker that runs its kernel was ended by SIGKILL"), reason
    assert "SIGTERM" in killed_reason(-signal.SIGTERM, False)


def test_a_worker_that_exited_or_was_interrupted_is_not_called_killed():
    assert killed_reason(0, True) == killed_reason(1, True) == ""
    assert killed_reason(137, False) == ""          # an exit status, not bubblewrap's signal code
    assert killed_reason(-signal.SIGINT, False) == ""     # Ctrl-C: the grader stops too
