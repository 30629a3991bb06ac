"""The reason a grading worker ended by a signal is given (issue 42): the submission killed its
grader, not the kernel's last log line. tests/test_grade_hostile.py grades the real attack."""

from __future__ import annotations

import signal

from ddplab.grade.isolation import Plain, killed_reason
from ddplab.grade.sandbox import Bubblewrap
from ddplab.grade.unprivileged import Account, AnotherAccount

SANDBOX, PLAIN = Bubblewrap(), Plain("no bwrap")
ACCOUNT = AnotherAccount(Account("nobody", 65534, 65534), "no bwrap")


def test_a_worker_killed_under_the_sandbox_or_without_says_the_submission_killed_it():
    for returncode, isolated in ((128 + signal.SIGKILL, SANDBOX), (-signal.SIGKILL, PLAIN),
                                 (-signal.SIGKILL, ACCOUNT), (-signal.SIGKILL, SANDBOX)):
        reason = killed_reason(returncode, isolated)
        assert reason.startswith("not graded: the submission killed its grader: the grading "
                                 "worker that runs its kernel was ended by SIGKILL"), reason
    assert "SIGTERM" in killed_reason(-signal.SIGTERM, PLAIN)


def test_a_worker_that_exited_or_was_interrupted_is_not_called_killed():
    assert killed_reason(0, SANDBOX) == killed_reason(1, SANDBOX) == ""
    for isolated in (PLAIN, ACCOUNT):      # an exit status, not bubblewrap's signal code
        assert killed_reason(137, isolated) == ""
    assert killed_reason(-signal.SIGINT, PLAIN) == ""     # Ctrl-C: the grader stops too
    assert killed_reason(128 + signal.SIGINT, SANDBOX) == ""
