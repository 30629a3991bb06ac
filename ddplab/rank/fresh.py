"""Fresh code on a rank: the user's own modules as their files are now, reloaded before a job, not in it.

A rank is a process that outlives the jobs it runs. A module it imported keeps
the code it had then, where a new process (``torch.multiprocessing.spawn``'s,
torchrun's) would import the file as it is now. The rule, for every job
(a ``%%ranks`` cell, ``lab.run``, ``lab.run_each``, ``lab.spawn``,
``lab.run_script``; docs/students.md, "Editing your own modules"):

1. Before the job, ``refresh`` reloads each of the user's modules whose file
   changed since this rank loaded it, in place (``importlib.reload``: the module
   object stays, so ``import mymod`` done earlier sees the new code), and rebinds
   the names taken from it (``from mymod import f``, in the rank's cells and in
   the user's other modules) to the new functions and classes.
2. Then the job's own code is unpickled (``engine.call_pickled``). The kernel
   sends a function or class of the user's modules *by name*, as pickle does, so
   here it is the object ``sys.modules[...]`` names, fresh.
3. Nothing is reloaded while the job runs: every object the job holds is the one
   its module names, for the whole job. torch's RPC, multiprocessing, pickle and
   ``torch.save`` pickle functions and classes by reference and require exactly
   that (``rpc.rpc_async(..., _run_trainer)`` fails with "it's not the same
   object as main._run_trainer" otherwise: issue 63).

What counts as the user's own: a module loaded from a ``.py`` file outside the
standard library, site-packages and ddplab (``users``). ``_Finder`` gives those
the ``_Loader``, which loads the text it reads and records what it read: from
its ``.pyc`` only where that was surely compiled from this text
(``_cached_code``; Python alone trusts a ``.pyc`` whose header names the
source's size and whole second of mtime, which a quick edit keeps).
``_changed`` compares a file's stat with the record (microseconds a module) and
reads the text only when the stat moved or was too fresh to trust (a file
written in the same clock tick as it was read may change again without its
stat moving: git's "racily clean" entries).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import marshal
import os
import re
import site
import sys
import sysconfig
import time
import types
from dataclasses import dataclass
from typing import Any

from ..errors import DdplabError

log = logging.getLogger(__name__)

#: A file whose mtime is this close to the moment it was read may change again without a new
#: mtime or size (coarse file-system clocks; NFS's, set by another machine): read it again.
RACY_NS = 2_000_000_000


class ReloadError(DdplabError):
    """A user's module changed on disk and its new version failed to load on this rank."""


@dataclass(frozen=True)
class _Read:
    """What a module's code was compiled from: its file's stat and a hash of its text."""
    file: str
    mtime_ns: int
    size: int
    digest: int
    read_ns: int                 # the wall clock just before the read


#: Each user module's ``_Read``, by module name.
_reads: dict[str, _Read] = {}
#: The entries of ``sys.path`` that ``follow_path`` added.
_added: list[str] = []
#: Whether each folder the import system has looked in holds the user's modules (``_forget_listings``).
_users_folders: dict[str, bool] = {}


def _library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    folders.add(site.getusersitepackages())
    folders.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))       # ddplab/
    return tuple({path + os.sep for folder in folders
                  for path in (os.path.abspath(folder), os.path.realpath(folder))})


_LIBRARIES = _library_folders()


def users(filename: str) -> bool:
    """Whether ``filename`` is a module of the user's own (not the standard library's,
    an installed package's or ddplab's)."""
    return (filename.endswith(".py") and not filename.startswith(_LIBRARIES)      # most imports
            and not os.path.realpath(filename).startswith(_LIBRARIES))


def _read(path: str) -> tuple[bytes, _Read]:
    now = time.time_ns()
    stat = os.stat(path)
    with open(path, "rb") as f:
        data = f.read()
    return data, _Read(path, stat.st_mtime_ns, stat.st_size, hash(data), now)


def _header(read: _Read) -> bytes:
    """A timestamp ``.pyc``'s 16-byte header for this text, as Python writes it (PEP 552)."""
    return (importlib.util.MAGIC_NUMBER + bytes(4)
            + (read.mtime_ns // 10**9 & 0xFFFFFFFF).to_bytes(4, "little")
            + (read.size & 0xFFFFFFFF).to_bytes(4, "little"))


def _cached_code(path: str, read: _Read) -> types.CodeType | None:
    """The code in the file's ``.pyc`` if it was surely compiled from this text, else None.

    Python trusts a ``.pyc`` whose header names the source's size and whole second
    of mtime, which an edit within that second keeps. Here the ``.pyc`` must also
    have been written ``RACY_NS`` after the source last changed, so compiled from
    the text as it is now (a compile that took that long aside).
    """
    try:
        cached = importlib.util.cache_from_source(path)
        if os.stat(cached).st_mtime_ns < read.mtime_ns + RACY_NS:
            return None
        with open(cached, "rb") as f:
            data = f.read()
        return marshal.loads(data[16:]) if data[:16] == _header(read) else None
    except (OSError, NotImplementedError, ValueError, EOFError, TypeError):
        return None


class _Loader(importlib.machinery.SourceFileLoader):
    """Python's own loader for a source file, loading the text it reads and recording it:
    its ``.pyc`` where ``_cached_code`` trusts it, else compiled (and the ``.pyc`` written)."""

    def get_code(self, fullname: str) -> types.CodeType:
        path = self.get_filename(fullname)
        data, read = _read(path)
        code = _cached_code(path, read)
        if code is None:
            code = self.source_to_code(data, path)
            if not sys.dont_write_bytecode:
                try:
                    self.set_data(importlib.util.cache_from_source(path),
                                  _header(read) + marshal.dumps(code))
                except NotImplementedError:          # no cache tag: no .pyc at all
                    pass
        _reads[fullname] = read             # only once it loaded: a broken edit is retried
        return code


class _Finder:
    """On ``sys.meta_path`` just before ``PathFinder``: its specs, with ``_Loader`` for the
    user's own files (a spec it finds is the one ``PathFinder`` would find next)."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if (spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader
                and spec.origin and users(spec.origin)):
            spec.loader = _Loader(spec.name, spec.origin)
        return spec


def install() -> None:
    """Put ``_Finder`` on ``sys.meta_path`` (once): the user's modules imported from now on
    are the ones ``refresh`` keeps fresh."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    finders = sys.meta_path
    at = (finders.index(importlib.machinery.PathFinder)
          if importlib.machinery.PathFinder in finders else len(finders))
    finders.insert(at, _Finder())


def follow_path(kernel_path: list[str]) -> None:
    """Let this rank find what the kernel finds: the kernel's ``sys.path`` entries, appended.

    The rank's own entries stay first; an entry added here that the kernel has
    since dropped is removed again.
    """
    wanted = set(kernel_path)
    for entry in [entry for entry in _added if entry not in wanted]:
        _added.remove(entry)
        while entry in sys.path:
            sys.path.remove(entry)
    for entry in kernel_path:
        if entry not in sys.path:
            sys.path.append(entry)
            _added.append(entry)


def _forget_listings() -> None:
    """Have the import system list the user's folders again (not the libraries').

    A folder's listing is cached until its mtime moves: a module file written in
    the same clock tick as the last listing would not be found.
    """
    for entry, finder in list(sys.path_importer_cache.items()):
        users_folder = _users_folders.get(entry)
        if users_folder is None:
            users_folder = _users_folders[entry] = not (
                os.path.realpath(entry or ".") + os.sep).startswith(_LIBRARIES)
        if users_folder and hasattr(finder, "invalidate_caches"):
            finder.invalidate_caches()


def refresh(namespace: dict, kernel_path: list[str] | None = None) -> list[str]:
    """Before a job: reload the user's modules whose files changed, rebind names; see the module.

    ``namespace``: the rank's cells' globals, whose names are rebound too.
    ``kernel_path``: the kernel's ``sys.path`` (``follow_path``). Returns the
    names of the modules reloaded. Raises ``ReloadError`` if one fails to load:
    the job must not run, with the old code or half the new.
    """
    install()
    if kernel_path is not None:
        follow_path(kernel_path)
    _forget_listings()
    changed = [name for name in list(_reads) if _changed(name) and _reachable(name)]
    if not changed:
        return []
    order = list(sys.modules)                 # imports first: a module before those it imports
    replaced: dict[int, tuple[Any, Any]] = {}
    try:
        for name in sorted(changed, key=order.index, reverse=True):
            replaced.update(_reload(sys.modules[name]))
    finally:                                  # what did reload is rebound, even if one failed
        _rebind(replaced, [namespace] + [vars(sys.modules[name]) for name in _reads
                                         if name in sys.modules])
    log.debug("reloaded %s", changed)
    return changed


def _rebind(replaced: dict[int, tuple[Any, Any]], spaces: list[dict]) -> None:
    """In each namespace, a name bound to a replaced object now names its replacement."""
    for space in spaces:
        for key, value in list(space.items()):
            pair = replaced.get(id(value))
            if pair is not None and pair[0] is value:
                space[key] = pair[1]


def _changed(name: str) -> bool:
    """Whether the text of module ``name``'s file is not what its code was compiled from."""
    read, module = _reads[name], sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != read.file:
        del _reads[name]                      # forgotten (run_script drops its folder's), or replaced
        return False
    try:
        stat = os.stat(read.file)
        if ((stat.st_mtime_ns, stat.st_size) == (read.mtime_ns, read.size)
                and read.read_ns - read.mtime_ns > RACY_NS):
            return False
        data, now = _read(read.file)
    except OSError:                           # deleted or moved: the module keeps what it has
        return False
    if now.digest != read.digest:
        return True
    _reads[name] = now                        # touched, not changed
    return False


def _reachable(name: str) -> bool:
    """Whether importing ``name`` now would load the file it was loaded from.

    ``lab.run_script`` puts the script's folder on ``sys.path`` only while it runs:
    the script's own modules, edited since, are not reloaded here (their imports of
    each other would fail) but left to ``run_script``, which imports them afresh;
    a module whose folder comes back on the path is reloaded then.
    """
    parent = name.rpartition(".")[0]
    path = getattr(sys.modules.get(parent), "__path__", None) if parent else None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    return spec is not None and spec.origin == _reads[name].file


def _reload(module: types.ModuleType) -> dict[int, tuple[Any, Any]]:
    """Reload ``module`` in place; its replaced functions and classes, ``{id(old): (old, new)}``."""
    name, before, read = module.__name__, dict(vars(module)), _reads[module.__name__]
    try:
        importlib.reload(module)
    except BaseException as e:
        _reads[name] = read                   # not loaded: the next job tries again
        if not isinstance(e, Exception):      # an interrupt is the user's, not the file's
            raise
        raise ReloadError(
            f"ddplab: module {name} changed on disk ({read.file}), and its new version failed "
            f"to load on rank {os.environ.get('RANK', '?')}. The job did not run (it would have "
            f"run the old code). Fix the file and run again: each cell or call tries the file "
            f"again first.") from e
    return {id(old): (old, vars(module)[key]) for key, old in before.items()
            if isinstance(old, (types.FunctionType, type)) and getattr(old, "__module__", None) == name
            and vars(module).get(key, old) is not old}


def explain(exc: BaseException) -> str:
    """For a job whose code could not be unpickled here: why, and the fix ("" if not ours)."""
    if isinstance(exc, AttributeError) and "Can't get attribute" in str(exc):
        found = re.search(r"Can't get attribute '([^']+)' on <module '([^']+)'", str(exc))
        module = sys.modules.get(found.group(2)) if found else None
        if module is not None:
            obj = found.group(1)
            return (f"\nddplab: each rank loads {module.__name__} from its file as the file is now "
                    f"({module.__file__}), and it defines no {obj}, which the kernel sent by name. "
                    f"Save the file if your editor holds the change; if {obj} was renamed or removed "
                    f"there, run importlib.reload({module.__name__}) in the notebook too.")
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (f"\nddplab: rank {os.environ.get('RANK', '?')} cannot import {exc.name}, the module "
                f"of what the kernel sent: functions and classes of your own modules travel by "
                f"name, and each rank imports the module. This rank looks where the kernel looks "
                f"(its sys.path); on a lab across several hosts, copy the module to the same path "
                f"on each host.")
    return ""
