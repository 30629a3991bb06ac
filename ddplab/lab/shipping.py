"""How a job's code travels from the kernel to the ranks: pickled once, by name, loaded fresh.

Every job that runs the user's code on the ranks (``lab.run``, ``lab.run_each``,
``lab.spawn``, ``lab.run_script``) is one ``engine.call_pickled`` per rank, with
``pack``'s bytes, the rank's own arguments and the kernel's ``sys.path``; a
``%%ranks`` cell sends its source and the kernel's ``sys.path``. On the rank,
``ddplab.rank.fresh`` first reloads the user's modules whose files changed,
then the job is unpickled. The rule this gives (docs/students.md, "Editing
your own modules"):

- A function or class of a module the user wrote (``mymod.py``) travels *by
  name*, as pickle sends it: the rank looks it up in its own ``mymod``, freshly
  loaded from the file as it is now. So it is the object ``sys.modules["mymod"]``
  names there, which torch's RPC, multiprocessing and pickle require of anything
  they pickle by reference (issue 63), and it is the file's code of now, as in
  a process of its own: ``torch.multiprocessing.spawn``'s children and torchrun's
  workers import the file too. The kernel's copy of ``mymod`` is not consulted
  (reload it there too, ``importlib.reload``, to run the same code in the notebook).
- A function defined in the notebook has no file: cloudpickle sends it by
  value, with the globals it uses.
- The ranks look for modules where the kernel looks now (its ``sys.path``), so a
  module the notebook imports from a folder it added is found on the ranks too.

The same pickler ipyparallel uses in this process does the pickling
(cloudpickle in a kernel; plain pickle in the grader's view of a lab,
``lab.attached``).
"""

from __future__ import annotations

import sys
from typing import Callable

from ..errors import ConfigError


def pack(what: str, fn: Callable, common: tuple = (), kwargs: dict | None = None,
         named: Callable | None = None) -> bytes:
    """``(fn, common, kwargs)`` pickled once for every rank of a job (``engine.call_pickled``).

    ``what`` names the call for the error (``"lab.run"``, ``"lab.spawn"``, ...),
    ``named`` the user's function in it (by default ``fn``).
    """
    from ipyparallel.serialize import serialize
    try:
        return serialize.pickle.dumps((fn, tuple(common), dict(kwargs or {})),
                                      serialize.PICKLE_PROTOCOL)
    except Exception as e:        # pickle's errors are TypeError, AttributeError, PicklingError...
        if "pickle" not in str(e).lower():
            raise
        name = getattr(named or fn, "__name__", "fn")
        raise ConfigError(f"ddplab: {what} could not send {name} and its "
                          f"arguments to the ranks ({e}). Pass plain data (numbers, strings, lists, "
                          f"dicts, tensors), not objects that hold open files, sockets, locks or "
                          f"threads; make those on the rank, inside the function.") from e


def kernel_path() -> list[str]:
    """Where the kernel looks for modules now: each job's ranks look there too (``fresh.follow_path``)."""
    return list(sys.path)
