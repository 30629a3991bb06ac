"""``ddplab.scratch_folder``: a folder for a notebook's files that nothing leaves behind.

A notebook that saves checkpoints or writes scripts for ``torchrun`` needs a
folder every rank on this machine can read and write, that outlives
``lab.restart()`` and ``ddplab.start()`` replacing one lab by another (a
checkpoint saved by 4 ranks, loaded by 2), and that goes when the work ends,
however it ends. ``tempfile.mkdtemp`` gives the first two and never the last:
a kernel stopped before its clean-up cell leaves the folder forever.

The folder is made in the directory of the kernel's engine template
(``ddplab.lab.template``), the one process that lives from the first lab to
the last ``lab.stop()`` and watches the kernel. So it goes

- with the last lab: ``lab.stop()`` ends the template, which removes its directory;
- when the kernel exits, or dies (``kill -9``, a grader stopping a submission):
  the template sees its parent gone within half a second and removes it.

Where engines are not forked from a template (``DDPLAB_FORK=0``, or a grading
run's borrowed template), the folder is an owner-only one in the temporary
folder, removed when the kernel exits (and, for a graded submission, with the
grader's folder).
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile

from ..errors import ConfigError
from . import template

__all__ = ["scratch_folder"]

#: What a name may be: letters, digits, ``-``, ``_`` and ``.``, not only dots, and short enough
#: that ``ddplab-NAME-xxxxxxxx`` fits one file name (255 bytes on Linux) with room to spare.
NAME_RULE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def scratch_folder(name: str = "scratch") -> str:
    """A fresh, empty, owner-only folder (its path) for this kernel's files, named ``ddplab-NAME-...``.

    Every rank on this machine can use it; it outlives restarts and replaced
    labs, and goes with the last ``lab.stop()`` or the kernel (see the module).
    ``name`` is one word of a file name (``NAME_RULE``): ``ConfigError`` otherwise.
    """
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name) or not name.strip("."):
        long = isinstance(name, str) and len(name) > 64
        got = f"{name[:24]!r}... ({len(name)} characters)" if long else repr(name)
        raise ConfigError(
            f"ddplab: scratch_folder's name must be one short word for a folder name: letters, "
            f"digits, '-', '_' or '.', 1 to 64 of them (not only dots), but got {got}. It names "
            f"one folder, never a path: use e.g. scratch_folder('nb10'), and make sub-folders "
            f"inside it with os.makedirs(os.path.join(folder, 'a', 'b')).")
    home = getattr(template.shared(), "directory", "") if template.enabled() else ""
    folder = tempfile.mkdtemp(prefix=f"ddplab-{name}-", dir=home or None)
    if not home:
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
