"""``ddplab autograder``: the zip Gradescope runs to grade one assignment with ``ddplab grade``.

    ddplab autograder notebooks/06_build_all_reduce.ipynb -o autograder.zip

Gradescope builds an image from the zip once (``setup.sh``, as root, on its
Ubuntu base image) and then, for each student's submission, copies the
uploaded files to ``/autograder/submission/`` and runs ``run_autograder`` as
root; the score is whatever ``/autograder/results/results.json`` says when it
ends. The zip holds:

- ``setup.sh``: a Python environment at ``/opt/ddplab`` that every user may
  read (torch's CPU build at the version that graded the reference here, then
  ddplab with the other packages pinned to this machine's versions,
  ``constraints.txt``), and ``ddplab-student``, a user without rights;
- ``run_autograder``: ``ddplab grade`` of the submission against the
  reference, writing ``results.json`` as it goes (a run stopped by
  Gradescope's time limit still reports what finished), with
  ``--run-as ddplab-student``: Gradescope's container has no bubblewrap, so
  without it a submission would run as root and could rewrite its own
  results. The reference folder is made root's alone before grading starts;
- ``reference/``: the reference notebooks (solutions and check outputs in);
- ``ddplab-src/``: this ddplab, without the course notebooks it ships (the
  solutions are in ``reference/``, where the student's user cannot read).

``AUTOGRADER_ROOT``, ``DDPLAB_PYTHON`` and ``DDPLAB_STUDENT_USER`` move the
tree, the environment and the user, for a rehearsal on your own machine
(``tests/test_autograder.py`` runs the hostile class so, on a fake
``/autograder`` tree). Gradescope's base image must have Python 3.11 or
newer (Ubuntu 24.04).
"""

from __future__ import annotations

import importlib.metadata as metadata
import io
import os
import tempfile
import zipfile
from pathlib import Path

from ..errors import CourseError
from ..grade.plan import check_reference

__all__ = ["STUDENT_USER", "build"]

#: The user submissions run as on Gradescope (``setup.sh`` creates it).
STUDENT_USER = "ddplab-student"

SETUP = """\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder (made by `ddplab autograder`).
set -euo pipefail
SOURCE="$(cd "$(dirname "$0")" && pwd)"
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv
python3 -m venv /opt/ddplab
/opt/ddplab/bin/python -m pip install --quiet --upgrade pip
# torch's CPU build (PyPI's is the multi-GB CUDA one), the version that graded the reference.
/opt/ddplab/bin/python -m pip install --quiet "torch==@TORCH@" \\
    --index-url https://download.pytorch.org/whl/cpu
/opt/ddplab/bin/python -m pip install --quiet -c "$SOURCE/constraints.txt" "$SOURCE/ddplab-src"
chmod -R a+rX /opt/ddplab
# Submissions run as this user: without rights, it cannot write the results or read the reference.
id -u @USER@ >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin @USER@
chmod -R go-rwx "$SOURCE"
"""

RUN = """\
#!/usr/bin/env bash
# Gradescope runs this for each submission, as root (made by `ddplab autograder`).
set -uo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PYTHON="${DDPLAB_PYTHON:-/opt/ddplab/bin/python}"
STUDENT_USER="${DDPLAB_STUDENT_USER:-@USER@}"
cd "$ROOT"            # never a folder whose Python files would be imported first
mkdir -p "$ROOT/results"
chmod 755 "$ROOT/results"
# The reference notebooks hold the solutions: only root may enter.
chmod -R go-rwx "$ROOT/source"
LOG="$(mktemp)"
"$PYTHON" -m ddplab grade "$ROOT/submission" --reference "$ROOT/source/reference" \\
    --gradescope "$ROOT/results/results.json" --run-as "$STUDENT_USER" --cell-timeout @TIMEOUT@ \\
    2>&1 | tee "$LOG"
# Not graded at all (no notebook of this assignment in the upload, say): tell the student why,
# rather than Gradescope's "the autograder failed to produce output".
if [ ! -s "$ROOT/results/results.json" ]; then
    "$PYTHON" -c 'import json, sys
why = (open(sys.argv[1]).read().strip().splitlines() or ["the grader printed nothing"])[-1]
json.dump({"score": 0, "output": "Not graded: " + why}, open(sys.argv[2], "w"))' \\
        "$LOG" "$ROOT/results/results.json"
fi
rm -f "$LOG"
"""


def _grading_requirements() -> list[str]:
    """What grading needs: ddplab's dependencies and its ``grade`` extra (nbval), names only."""
    needed = []
    for requirement in metadata.requires("ddplab") or []:
        name, _, marker = requirement.partition(";")
        if not marker.strip() or marker.replace(" ", "").replace("'", '"') == 'extra=="grade"':
            needed.append(name.strip())
    return needed


def _constraints() -> str:
    """Those requirements pinned to the versions installed here (which graded the reference)."""
    lines = ["# The versions that graded the reference (written by `ddplab autograder`)."]
    lines += [f"{name}=={metadata.version(name)}" for name in _grading_requirements()]
    return "\n".join(lines) + "\n"


def _pyproject() -> str:
    listed = "".join(f'    "{d}",\n' for d in _grading_requirements())
    return ('[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "ddplab"\nversion = "{metadata.version("ddplab")}"\n'
            f'requires-python = ">=3.11"\ndependencies = [\n{listed}]\n\n'
            '[project.scripts]\nddplab = "ddplab.course.cli:main"\n\n'
            '[tool.setuptools.packages.find]\ninclude = ["ddplab*"]\n\n'
            '[tool.setuptools.package-data]\n"ddplab.grade" = ["nbval_sanitize.cfg"]\n')


def _package_files() -> list[tuple[Path, str]]:
    """This ddplab's files and their names in the zip; not the course notebooks (solutions)."""
    import ddplab
    package = Path(ddplab.__file__).resolve().parent
    return [(path, "ddplab-src/ddplab/" + path.relative_to(package).as_posix())
            for path in sorted(package.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
            and not path.relative_to(package).as_posix().startswith("course/notebooks/")]


def build(notebooks: list[str | Path], output: str | Path, *, cell_timeout: float = 120,
          user: str = STUDENT_USER) -> Path:
    """Write Gradescope's autograder zip for the assignment made of ``notebooks`` (references).

    Each reference is checked first (its check cells carry their outputs), so
    an unusable one stops here, not on Gradescope. Returns the zip's path.
    """
    import torch

    output = Path(output)
    if output.suffix != ".zip":
        raise CourseError(f"ddplab autograder: -o {output} must name a .zip file "
                          f"(Gradescope takes the autograder as a zip).")
    if not output.parent.is_dir():
        raise CourseError(f"ddplab autograder: -o {output}: the folder {output.parent} does not "
                          f"exist. Create it, or name a zip in an existing folder.")
    references = [Path(n) for n in notebooks]
    names = [p.name for p in references]
    for path in references:
        if not path.is_file() or path.suffix != ".ipynb":
            raise CourseError(f"ddplab autograder: {path} is not a notebook. Name the reference "
                              f"notebooks of the assignment (e.g. notebooks/06_build_all_reduce.ipynb).")
        check_reference(path)          # GradeError with the fix, for a reference without outputs
    if len(set(names)) != len(names):
        raise CourseError(f"ddplab autograder: two references are named alike ({names}): "
                          f"submissions are matched by file name.")
    scripts = {"setup.sh": SETUP, "run_autograder": RUN}
    values = {"@TORCH@": torch.__version__, "@USER@": user, "@TIMEOUT@": f"{cell_timeout:g}"}
    for name, text in scripts.items():
        for token, value in values.items():
            text = text.replace(token, value)
        scripts[name] = text
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in scripts.items():       # executable: Gradescope runs them as they are
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16
            zf.writestr(info, text)
        zf.writestr("constraints.txt", _constraints())
        zf.writestr("ddplab-src/pyproject.toml", _pyproject())
        for path, name in _package_files():
            zf.write(path, name)
        for path in references:
            zf.write(path, f"reference/{path.name}")
    # Whole or not at all: a zip cut short would fail on Gradescope, not here.
    with tempfile.NamedTemporaryFile(dir=output.parent, delete=False, suffix=".zip") as tmp:
        tmp.write(buffer.getvalue())
    os.replace(tmp.name, output)
    return output
