"""The environment every student's server runs on a class server: one, world-readable, reused.

On a JupyterHub the admin installs ddplab once, into an environment every user
may read (docs/class-server.md): ``pip install -c
constraints.txt`` of ddplab and jupyterhub, so torch is the pinned one. This
checkout cannot serve: CI clones it into a folder other users may not enter
(``/root``), and ``.venv``'s interpreter may live there too (pyenv). So
``ensure()`` builds that environment under ``/var/tmp/ddplab-hub-env/``, owned
by root, every folder 0755, and reuses it:

- its folder is named by a hash of what decides the dependencies (pyproject.toml,
  constraints.txt, the interpreter): a change there builds a new one beside it;
- ddplab itself is reinstalled (``--no-deps``, seconds) when its own files change
  (``ddplab/``, ``notebooks/``, setup.py), recorded in the folder.

The interpreter is one every user may run: this one's base, or Debian's
``/usr/bin/python3``. Building takes a lock (two test runs on one machine build
it once) and writes ``.complete`` last, so a build cut short is redone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pwd
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labprobe import runs_as

ROOT = Path(__file__).resolve().parent.parent
HOME = Path("/var/tmp/ddplab-hub-env")
NOBODY = pwd.getpwnam("nobody").pw_uid
# JupyterLab asks in a pop-up whether to fetch news from the internet: the admin says never, for everyone.
LAB_OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                                  "checkForUpdates": False}}


@dataclass(frozen=True)
class SharedEnv:
    prefix: Path
    what: str                      # "built", "ddplab updated" or "reused"
    steps: dict[str, tuple[float, float]]   # each step of building or updating it: (wall, CPU) seconds

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.prefix / "bin" / name


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _package_files() -> list[Path]:
    files = [ROOT / "setup.py", ROOT / "MANIFEST.in", *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    files += sorted(p for p in (ROOT / "ddplab").rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix != ".pyc" and "course/notebooks" not in p.as_posix())
    return files


def interpreter() -> str:
    """A Python 3.11+ that every user may run, to base the environment on."""
    tried = []
    for candidate in (getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3"):
        tried.append(candidate)
        if not os.path.exists(candidate) or not runs_as(candidate, NOBODY):
            continue
        version = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version_info >= (3, 11))"],
                                 capture_output=True, text=True, timeout=60).stdout.strip()
        if version == "True":
            return candidate
    raise AssertionError(f"ddplab: the students' environment needs a Python 3.11+ with venv that every "
                         f"user may run, but none of {tried} is one (an interpreter under /root is out "
                         f"of their reach). Install Debian's python3 and python3-venv.")


def _run(steps: dict[str, tuple[float, float]], step: str, command: list[str], what: str,
         timeout: float, ok: tuple[int, ...] = (0,)) -> None:
    """Run one step of the build; record its wall time and the CPU time it used (which, unlike
    the wall time, does not depend on what else the machine is doing)."""
    begin, cpu = time.monotonic(), _children_cpu()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode in ok, (f"ddplab: {what} failed (exit {done.returncode}): "
                                  f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    steps[step] = (time.monotonic() - begin, _children_cpu() - cpu)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _install_ddplab(prefix: Path, steps: dict[str, tuple[float, float]], *, deps: bool) -> None:
    """Build ddplab's wheel from this checkout (this venv's setuptools) and install it into
    ``prefix``, with its dependencies and jupyterhub pinned by constraints.txt, or alone."""
    with tempfile.TemporaryDirectory() as dist:
        _run(steps, "wheel", [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                              "--no-build-isolation", "-w", dist, str(ROOT)], "building ddplab's wheel", 300)
        wheel = str(next(Path(dist).glob("ddplab-*.whl")))
        pip = [sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"), "install",
               "--quiet", "--no-compile"]
        if deps:
            _run(steps, "pip install", [*pip, "-c", str(ROOT / "constraints.txt"), wheel, "jupyterhub"],
                 "installing ddplab and jupyterhub into the students' environment", 1200)
        else:
            _run(steps, "pip install", [*pip, "--no-deps", "--force-reinstall", wheel],
                 "reinstalling ddplab", 300)
    # Root owns the environment, so users could not write bytecode: compile it here, on every core.
    # Exit 1 means some file did not compile (torch ships Python 3.12-only test files): pip, which
    # compiles as it installs, skips those too.
    site = next(prefix.glob("lib/python3*/site-packages"))
    target = site if deps else site / "ddplab"
    _run(steps, "compile", [str(prefix / "bin" / "python"), "-m", "compileall", "-q", "-j", "0", str(target)],
         "compiling the students' environment", 600, ok=(0, 1))


def ensure() -> SharedEnv:
    """The students' environment, built or brought up to date with this checkout."""
    python = interpreter()
    deps = _digest([ROOT / "pyproject.toml", ROOT / "constraints.txt"])
    key = hashlib.sha256(f"{deps} {os.path.realpath(python)}".encode()).hexdigest()[:16]
    package = _digest(_package_files())
    old = os.umask(0o022)                    # every file readable, every folder enterable, by all
    try:
        HOME.mkdir(mode=0o755, exist_ok=True)
        info = HOME.stat()
        assert info.st_uid == 0 and not info.st_mode & 0o022, (
            f"ddplab: {HOME} must belong to root and be writable by root only (it holds the Python "
            f"every student runs), but it is owned by uid {info.st_uid}, mode {oct(info.st_mode)}. "
            f"Remove it.")
        HOME.chmod(0o755)                    # made earlier under another umask, it may be 0700
        prefix = HOME / key
        steps: dict[str, tuple[float, float]] = {}
        with open(HOME / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            stamp = prefix / ".complete"
            if not stamp.exists():
                shutil.rmtree(prefix, ignore_errors=True)
                _run(steps, "venv", [python, "-m", "venv", "--without-pip", str(prefix)],
                     "creating the venv", 300)
                _install_ddplab(prefix, steps, deps=True)
                what = "built"
            elif json.loads(stamp.read_text()).get("ddplab") != package:
                _install_ddplab(prefix, steps, deps=False)
                what = "ddplab updated"
            else:
                what = "reused"
            settings = prefix / "share" / "jupyter" / "lab" / "settings"
            settings.mkdir(parents=True, exist_ok=True)
            (settings / "overrides.json").write_text(json.dumps(LAB_OVERRIDES))
            stamp.write_text(json.dumps({"ddplab": package, "python": python}))
    finally:
        os.umask(old)
    return SharedEnv(prefix, what, steps)
