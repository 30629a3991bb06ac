"""``lab.run_script`` on one rank: a script run as ``__main__``, as a fresh torchrun worker would run it.

The rank outlives the scripts it runs, so what a new process would give each
run for free is made here: ``sys.argv``, ``sys.path[0]`` (the script's folder,
removed again after the run) and ``sys.modules["__main__"]`` are the script's
while it runs, and the modules of the script's folder are imported afresh
(``_forget_script_modules``). The lab's process group is set aside while it
runs (``owngroup.set_aside``), so the script makes its own.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any

from . import owngroup, rpcstate

#: Modules that earlier scripts imported from their own folders (dropped before the next run).
_script_modules: set[str] = set()


def run_script(path: str, argv: list[str], env: dict[str, str]) -> None:
    """Run the file at ``path`` as ``__main__`` with the lab's group set aside: one rank of
    ``lab.run_script``.

    Like ``python path *argv`` under torchrun: ``sys.argv``, ``sys.path[0]`` (the
    script's folder) and ``sys.modules["__main__"]`` are the script's while it runs,
    so classes it defines pickle (``torch.save``, DataLoader workers). Its globals
    are then copied into the rank's namespace, as IPython's ``%run`` does.
    """
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        raise FileNotFoundError(
            f"ddplab: rank {env.get('RANK', '?')} cannot read the script {path!r} ({e.strerror}). "
            f"Expected a file every rank can read at that path; on a lab across several hosts, "
            f"copy it to the same path on each host.") from e
    code = compile(source, path, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = path
    main, inits = sys.modules.get("__main__"), owngroup.inits()
    rpc_inits = rpcstate.inits()
    folder = os.path.dirname(os.path.abspath(path))
    _forget_script_modules(folder)
    before = set(sys.modules)
    with owngroup.set_aside(env, env["TORCHELASTIC_RUN_ID"]):
        sys.argv[:] = [path, *argv]
        sys.path.insert(0, folder)
        sys.modules["__main__"] = module
        try:
            exec(code, module.__dict__)
        except SystemExit as e:
            if e.code not in (None, 0):
                # The script's own frames only, down to its sys.exit: the engine leaves this
                # module's out (``engine._is_user_code``), and SystemExit's chain says no more.
                raise RuntimeError(f"the script exited with code {e.code!r} (sys.exit) on rank "
                                   f"{env.get('RANK', '?')}").with_traceback(
                                       e.__traceback__.tb_next) from None
        finally:
            sys.modules["__main__"] = main
            if sys.path and sys.path[0] == folder:
                del sys.path[0]              # a second run must not find this folder first
            _script_modules.update(name for name in set(sys.modules) - before
                                   if _inside(sys.modules[name], folder))
            _rank_namespace().update({k: v for k, v in module.__dict__.items()
                                       if not (k.startswith("__") and k.endswith("__"))})
    if owngroup.inits() == inits and rpcstate.inits() == rpc_inits:
        print(f"ddplab: the script finished on rank {env.get('RANK', '?')} without forming a "
              f"process group (it never called init_process_group nor rpc.init_rpc): it ran as one process, "
              f"not as part of {env.get('WORLD_SIZE', 'the')} ranks. A script that needs a GPU "
              f"may have skipped its training here (torch.cuda.is_available() is "
              f"{_cuda_available()}).", file=sys.stderr, flush=True)


def _inside(module: Any, folder: str) -> bool:
    file = getattr(module, "__file__", None) or ""
    return bool(file) and os.path.abspath(file).startswith(folder + os.sep)


def _forget_script_modules(folder: str) -> None:
    """Import a script's own modules afresh, as a new torchrun process would.

    A rank outlives the scripts it runs: without this, a second script's sibling
    ``model.py`` would be the first one's (``cannot import name 'GPTConfig' from
    'model'``), and an edited module would run as it was. Modules the earlier
    scripts imported from their folders, and any module already loaded from this
    script's folder, are dropped from ``sys.modules``; objects made from them live
    on, their modules just are not found by name any more.
    """
    stale = _script_modules | {name for name, module in list(sys.modules.items())
                               if _inside(module, folder)}
    for name in stale:
        sys.modules.pop(name, None)
    _script_modules.clear()
    importlib.invalidate_caches()        # a file written a moment ago is found


def _rank_namespace() -> dict:
    """What ``%%ranks`` cells see: the engine's IPython namespace (as ``engine.namespace()``,
    which imports this module: asking IPython ourselves keeps the two free of a cycle)."""
    from IPython import get_ipython
    shell = get_ipython()
    return shell.user_ns if shell is not None else {}


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# ------------------------------------------------------------------ a fresh rendezvous
