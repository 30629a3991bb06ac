"""Where a submission runs: a bubblewrap sandbox, when the machine has one.

``ddplab grade`` runs each submission's grading worker (and so its kernel,
its lab, and everything they start) as::

    bwrap --unshare-user --unshare-pid --unshare-net --unshare-ipc --die-with-parent ...

What that gives, and why each part:

- A pid namespace: the submission sees only its own processes. It cannot
  find, signal or read the grader, the other submissions, or their kernels;
  and when the worker exits, the kernel ends every process left in the
  namespace (SIGKILL), however it detached (double fork, ``setsid``,
  SIGTERM ignored). ``--die-with-parent``: if the grader dies, so does the
  sandbox.
- A file system of its own: read-only binds of the system (``/usr``,
  ``/etc``...), the Python installation and ddplab's package, and nothing
  else. The reference notebooks, the course's notebooks shipped in the
  package (what ``ddplab.solution`` reads), other students' submissions and
  the grader's outputs are not there. Nor is the source of the modules that
  hold an exercise's answer and that the notebooks' demos still run
  (``ANSWER_MODULES``: ``ddplab.algorithms``, notebook 06's all_reduces): each
  is replaced by a stand-in that runs its compiled code, so the demos work and
  there is no source to read or copy (a copy of the code objects is still the
  reference: ``ddplab.check.nb06_build_all_reduce._reference`` recognises it by its instructions).
  The checkers' answer keys (``ddplab/check/_keys/``) are empty files inside;
  the grading worker, which runs every check itself, gets them compiled in a
  file it reads and deletes before the submission's first cell runs.
  ``/tmp`` is a fresh, private tmpfs; the
  only writable folder is the submission's scratch folder, which holds a copy
  of its notebook and is its working directory. ``$HOME`` is in ``/tmp``.
- A network of its own: loopback only (the lab's ranks talk over it);
  nothing leaves the machine, and no other submission's lab is reachable.
- A user namespace: no capabilities, even when the grader runs as root.
- An environment reduced to what Python, Jupyter and torch need.

Without ``bwrap`` (or where the kernel forbids unprivileged user
namespaces), grading still runs, unsandboxed, and says so once when it
starts (``unavailable_reason``). ``DDPLAB_SANDBOX=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

#: Read-only binds of the system, where they exist.
SYSTEM = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc", "/sys"]
#: Files of /etc no submission needs to read (the grader may run as root).
HIDDEN_SYSTEM_FILES = ["/etc/shadow", "/etc/gshadow", "/etc/sudoers"]
#: Environment variables that pass into the sandbox (names, or prefixes ending in _).
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ", "PYTHONPATH", "PYTHONHASHSEED",
            "LC_", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "GLOO_", "DDPLAB_", "NCCL_", "CUDA_")
#: ddplab's modules whose source answers an exercise, and which notebooks still run (06's demos
#: draw and time the reference ring): in the sandbox, their compiled code without the source.
ANSWER_MODULES = ("algorithms",)
#: Set by the grader so that a submission's kernel borrows no process from outside.
DROP_ENV = ("DDPLAB_TEMPLATE",)


def requested() -> bool:
    return os.environ.get("DDPLAB_SANDBOX", "1") not in ("0", "no", "off", "false")


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str:
    """'' when submissions can be sandboxed here, else one line saying why not."""
    if not requested():
        return "DDPLAB_SANDBOX=0 is set"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ("bubblewrap (bwrap) is not installed; on Debian/Ubuntu: "
                "apt-get install bubblewrap (tools/ensure_sandbox.sh)")
    from .. import procs
    try:
        with procs.adopting():          # the probe's sandbox leaves an orphan too: reaped here
            probe = procs.run([wrap(["/bin/true"], scratch=None, bwrap=bwrap)], timeout=30)
    except OSError as e:
        return f"bwrap cannot start here ({e})"
    if not probe.ok:
        last = (probe[0].output.strip().splitlines() or ["no message"])[-1]
        return f"bwrap cannot make a sandbox here ({last[:120]}); user namespaces may be off"
    return ""


def _package_dirs() -> list[Path]:
    """What the worker imports from: the Python installation, its site-packages, ddplab."""
    import ddplab
    dirs = {Path(sys.prefix), Path(sys.base_prefix), Path(ddplab.__file__).resolve().parent}
    for entry in sys.path:
        path = Path(entry).resolve() if entry else None
        if path and path.is_dir() and any(part in ("site-packages", "dist-packages")
                                          or part.startswith("python3") for part in path.parts):
            dirs.add(path)
    # a parent bound makes its children redundant (and bwrap binds in order)
    return sorted(d for d in dirs if not any(o != d and o in d.parents for o in dirs))


def _hidden_dirs() -> list[Path]:
    """Folders inside the binds that hold solutions: the course notebooks shipped with ddplab."""
    import ddplab
    package = Path(ddplab.__file__).resolve().parent
    return [d for d in (package / "course" / "notebooks",) if d.is_dir()]


def _write_stand_ins(folder: Path) -> list[tuple[Path, Path]]:
    """Per ``ANSWER_MODULES`` entry: (a stand-in written in ``folder``, the installed source it hides).

    The stand-in is a module that runs the original's code object, compiled
    here from the installed file and carried marshalled: the functions it
    defines are the reference's, under the installed file's name, and no line
    of the source is in the sandbox.
    """
    import marshal

    import ddplab
    package = Path(ddplab.__file__).resolve().parent
    folder.mkdir(exist_ok=True)
    made = []
    for name in ANSWER_MODULES:
        installed = package / f"{name}.py"
        code = compile(installed.read_text(), str(installed), "exec")
        stand_in = folder / f"{name}.py"
        stand_in.write_text(
            f'"""ddplab.{name}, compiled: a grading sandbox holds no source of the answers its '
            f'demos run\n(ddplab.grade.sandbox)."""\n'
            f"import marshal as _marshal\n\nexec(_marshal.loads({marshal.dumps(code)!r}))\n")
        made.append((stand_in, installed))
    return made


#: The variable naming the answer keys' file for the grading worker (``ddplab.check._keys`` reads
#: it when imported, deletes the file, and takes the variable out of the environment it passes on).
ANSWER_KEYS_VARIABLE = "DDPLAB_ANSWER_KEYS"


def answer_key_sources() -> list[Path]:
    """The installed sources of ``ddplab.check``'s answer keys (``ddplab/check/_keys/*.py``)."""
    import ddplab
    folder = Path(ddplab.__file__).resolve().parent / "check" / "_keys"
    return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")


def answer_keys_blob() -> bytes:
    """Every answer key compiled and marshalled: ``{name: marshalled code}``, what the worker seals."""
    import marshal
    return marshal.dumps({p.stem: marshal.dumps(compile(p.read_text(), str(p), "exec"))
                          for p in answer_key_sources()})


def _write_answer_keys(scratch: Path) -> Path:
    """The compiled keys in ``scratch`` (readable by a worker of another user; it deletes them)."""
    path = scratch / "answer-keys"
    path.write_bytes(answer_keys_blob())
    path.chmod(0o644)
    return path


def wrap(command: list[str], *, scratch: Path | None, bwrap: str | None = None) -> list[str]:
    """``command`` run in a sandbox whose one writable folder is ``scratch`` (its working dir)."""
    args = [bwrap or shutil.which("bwrap") or "bwrap",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for path in SYSTEM:
        args += ["--ro-bind-try", path, path]
    for path in HIDDEN_SYSTEM_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    for path in _package_dirs():
        args += ["--ro-bind", str(path), str(path)]
    for path in _hidden_dirs():
        args += ["--tmpfs", str(path)]
    if scratch is not None:
        args += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch)]
        stand_ins = _write_stand_ins(scratch / "answers")
        # Read-only from inside, although under the one writable folder: bound after it.
        args += ["--ro-bind", str(scratch / "answers"), str(scratch / "answers")]
        for stand_in, installed in stand_ins:
            args += ["--ro-bind", str(stand_in), str(installed)]
        # The checkers' answer keys: no source inside; the worker gets them compiled, in a file
        # it deletes before the submission's first cell (ddplab.check._keys).
        empty = scratch / "answers" / "empty.py"    # /dev/null would read as "permission denied"
        empty.write_text("")
        for source in answer_key_sources():
            args += ["--ro-bind", str(empty), str(source)]
        args += ["--setenv", ANSWER_KEYS_VARIABLE, str(_write_answer_keys(scratch))]
    args += ["--dir", "/tmp/home", "--setenv", "HOME", "/tmp/home", "--setenv", "TMPDIR", "/tmp"]
    return args + ["--", *command]


def environment(env: dict) -> dict:
    """The variables a sandboxed worker gets: what Python, Jupyter and torch need."""
    return {k: v for k, v in env.items()
            if k not in DROP_ENV and any(k == keep or (keep.endswith("_") and k.startswith(keep))
                                         for keep in KEEP_ENV)}
