"""What every process a launch starts runs first: ``sitecustomize.py`` on its ``PYTHONPATH``.

Written into the launch's folder (``install``), it wraps ``init_process_group``
in each launched Python process (torchrun's agent and workers, a script and the
processes its ``mp.spawn`` starts) and leaves notes there for the launch to read:

- ``formed-PID``: that process formed a process group (``formed``: a launch whose
  processes all exited 0 without one did not train);
- a restarted torchrun attempt meets under keys of its own attempt;
- ``waiting-PID``: the stack of the torch.distributed call the process's main
  thread sits in, and since when, kept by a thread that looks twice a second
  (``waited``: a rank that sat a whole timeout in one call ends the launch,
  whatever the other ranks do).
"""

from __future__ import annotations

import glob
import json
import os
import time

from ..rank.where import locate

# On the launched processes' PYTHONPATH as sitecustomize.py: each init_process_group that
# succeeds leaves a file in the launch's folder, and one in a restarted torchrun attempt meets
# under keys of its own attempt. (torch.distributed imports distributed_c10d's names as it
# loads, so a finder wraps the module as it is executed.)
SOURCE = """
import importlib.machinery, inspect, os, sys

class _Finder:
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed.distributed_c10d":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.init_process_group
            signature = inspect.signature(real)

            def init_process_group(*args, **kwargs):
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                bound = signature.bind(*args, **kwargs).arguments
                if attempt != "0" and bound.get("store") is None:
                    # A restart meets at the same agent store, where the last attempt's
                    # keys still are; read before overwritten, they hang the new group.
                    timeout = bound.get("timeout") or module.default_pg_timeout
                    store, rank, size = next(module.rendezvous(
                        bound.get("init_method") or "env://", bound.get("rank", -1),
                        bound.get("world_size", -1), timeout=timeout))
                    bound.update(init_method=None, rank=rank, world_size=size,
                                 store=module.PrefixStore("attempt_" + attempt, store))
                result = real(**bound)
                open(os.path.join(os.environ["DDPLAB_LAUNCH_DIR"],
                                  "formed-%d" % os.getpid()), "w").close()
                _watch_waits(os.environ["DDPLAB_LAUNCH_DIR"])
                return result
            init_process_group.__wrapped__ = real
            module.init_process_group = init_process_group
        spec.loader.exec_module = exec_module
        return spec

_watching = []


def _watch_waits(folder):
    # A thread that notes, in waiting-PID, the stack of the torch.distributed call the main
    # thread sits in and since when: the same call is the same frame object, held while it
    # lasts (a new call gets a new one). ddplab reads it to end a launch whose rank waited
    # a whole timeout, whatever the others do.
    import json, threading, time
    if _watching:
        return
    _watching.append(True)
    main, path = threading.main_thread().ident, os.path.join(folder, "waiting-%d" % os.getpid())
    c10d = os.path.join("torch", "distributed", "distributed_c10d.py")

    def look():
        held = None
        while True:
            time.sleep(0.5)
            frame = sys._current_frames().get(main)
            call, stack = None, []
            while frame is not None:
                code = frame.f_code
                if call is None and code.co_filename.endswith(c10d) and not code.co_name.startswith("_"):
                    call = frame
                stack.append((code.co_filename, frame.f_lineno, code.co_name))
                frame = frame.f_back
            if call is held:
                continue
            held = call
            try:
                if call is None:
                    os.remove(path)
                else:
                    with open(path + ".tmp", "w") as f:
                        json.dump({"rank": os.environ.get("RANK"), "since": time.time(),
                                   "frames": stack}, f)
                    os.replace(path + ".tmp", path)
            except OSError:
                pass
            call = stack = None

    threading.Thread(target=look, name="ddplab-waits", daemon=True).start()


if os.environ.get("DDPLAB_LAUNCH_DIR"):
    sys.meta_path.insert(0, _Finder())
"""


def install(folder: str) -> str:
    """Write the hook into ``folder``/hook; the folder to put first on ``PYTHONPATH``."""
    os.mkdir(hook := os.path.join(folder, "hook"))
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(SOURCE)
    return hook


def formed(folder: str) -> int:
    """How many launched processes formed a process group."""
    return len(glob.glob(os.path.join(folder, "formed-*")))


def waited(folder: str, timeout: float) -> dict[int, str]:
    """The ranks whose main thread has sat in one torch.distributed call for ``timeout`` s
    or more (the launched processes note it in ``waiting-PID``, ``SOURCE``), and where."""
    found = {}
    for path in glob.glob(os.path.join(folder, "waiting-*[0-9]")):
        try:
            with open(path) as f:
                noted = json.load(f)
        except (OSError, ValueError):
            continue                          # gone, or not yet written: not stuck
        if time.time() - noted["since"] >= timeout:
            rank = int(noted["rank"]) if str(noted.get("rank")).isdigit() else len(found)
            found[rank] = locate([tuple(frame) for frame in noted["frames"]]).in_call()
    return found
