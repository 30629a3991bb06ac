"""Where there is no sandbox: run each submission as a user without rights.

Gradescope's autograder container (and many a Docker image) has no
bubblewrap and runs the autograder as root, so a submission would run as
root too: it could rewrite ``results.json``, read the reference notebooks,
or end the grader. ``ddplab grade --run-as USER`` (which the autograder zip
passes, ``ddplab autograder``) starts each grading worker, and so the
submission's kernel, its lab and all they start, as ``USER``:

- its work folder (a copy of the notebook, its temporary files, its home)
  is handed to ``USER``; nothing else it is given is writable to it;
- the grader keeps its own rights: results, CSV and journal are written by
  root, where ``USER`` cannot write, and ``USER`` cannot signal or trace it;
- no engine template is shared (one started by the grader would fork the
  submission's engines as root).

What ``USER`` can still read is what every user of the machine can: keep
the reference notebooks in a folder only root may enter (the autograder's
``run_autograder`` does, ``chmod 700``). Where bubblewrap works, the
sandbox is used instead (``ddplab.grade.sandbox``), and ``--run-as`` is not
needed. ``AnotherAccount`` is this module's ``Isolation``
(``ddplab.grade.isolation``).
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import procs
from ..errors import GradeError
from .isolation import Isolation, environment, worker_group


@dataclass(frozen=True)
class Account:
    """The user a submission runs as."""

    name: str
    uid: int
    gid: int


def account(name: str) -> Account:
    """``name``'s account, once it is known that submissions can run as it here; else GradeError."""
    if os.geteuid() != 0:
        raise GradeError(f"ddplab grade: --run-as {name} needs root (only root can start a "
                         f"process as another user). Run the grader as root, or drop --run-as.")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise GradeError(f"ddplab grade: --run-as {name}: there is no user {name!r} on this "
                         f"machine. Create one without rights first: useradd --system "
                         f"--no-create-home {name}") from None
    if entry.pw_uid == 0:
        raise GradeError(f"ddplab grade: --run-as {name}: {name!r} is root, which would give "
                         f"submissions every right. Name a user without rights.")
    try:
        probe = procs.run_command([sys.executable, "-c", "import ddplab"], timeout=120,
                                  user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
                                  cwd="/", capture_output=True, text=True)
        problem = "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]
    except OSError as e:
        problem = str(e)
    if problem:
        raise GradeError(f"ddplab grade: --run-as {name}: {name!r} cannot run this Python with "
                         f"ddplab ({sys.executable}: {problem[:120]}). Install ddplab in an "
                         f"environment every user may read (e.g. python3 -m venv /opt/ddplab).")
    return Account(name, entry.pw_uid, entry.pw_gid)


def hand_over(folder: Path, user: Account) -> None:
    """Make ``folder`` and everything in it ``user``'s (the grader keeps root's rights)."""
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, user.uid, user.gid, follow_symlinks=False)


class AnotherAccount(Isolation):
    """Each worker as ``user``, where there is no sandbox (``why``: why not)."""

    def __init__(self, user: Account, why: str) -> None:
        self.user, self.why = user, why

    def notice(self) -> str:
        return (f"ddplab grade: grading without a sandbox ({self.why}): each submission runs as "
                f"{self.user.name} (--run-as), and can read what every user of this machine can.")

    def worker(self, command: list[str], work: Path, env: dict) -> procs.Group:
        # Its home in the work folder too (the user's own may not exist), and only
        # the variables a sandboxed worker would get: the grader's are not its.
        (work / "home").mkdir()
        (work / "tmp").mkdir()
        env = dict(environment(env), HOME=str(work / "home"), TMPDIR=str(work / "tmp"))
        hand_over(work, self.user)
        return worker_group(command, env, user=(self.user.uid, self.user.gid),
                            cwd=str(work))        # the grader's may be shut to it
