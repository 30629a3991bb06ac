"""Submissions written by someone who wants the points, for ``tests/test_grade_hostile.py``.

Each attack is a notebook made from one small reference (``reference()``:
start a lab, some scores on each rank, one exercise, its check, stop), the
way a student would hand it in: cells added, cells changed. ``ATTACKS`` maps
a name to (what the attack does to the notebook, the score it deserves).
Code in the attacks names ``@MARKER@``, ``@REFERENCE@``, ``@OTHER@`` and
``@CSV@`` (and ``@SOLUTION@``): the test fills them in (a unique marker on every process an
attack leaves, so the test can find any that survive; the paths it must not
read or write).
"""

from __future__ import annotations

import nbformat
import psutil
from nbformat.v4 import new_code_cell, new_notebook, new_output

CORRECT = "Correct: every rank holds the mean of all 6 scores of the 2 ranks.\n"
SOLUTION = ("%%ranks\n### BEGIN SOLUTION\ntotals = torch.tensor([scores.sum().item(), "
            "float(len(scores))])\ndist.all_reduce(totals)\nmean_score = totals[:1] / totals[1]\n"
            "### END SOLUTION")
STUB = "%%ranks\n# YOUR CODE HERE\nraise NotImplementedError()"
NOTHING = "%%ranks\npass"


def reference():
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    out = lambda text: [new_output("stream", name="stdout", text=text)]   # noqa: E731
    nb.cells = [
        new_code_cell("# NBVAL_IGNORE_OUTPUT\nimport ddplab\nlab = ddplab.start(world_size=2)",
                      id="setup", outputs=out("ddplab: 2 ranks ready\n")),
        new_code_cell("%%ranks\nscores = torch.arange(1.0, 3.0 + 2 * rank)", id="scores"),
        new_code_cell(SOLUTION, id="exercise-mean-score", metadata={"tags": ["exercise"]}),
        new_code_cell("ddplab.check.mean_score()", id="check-mean-score",
                      metadata={"tags": ["check"]}, outputs=out(CORRECT)),
        new_code_cell("lab.stop()", id="stop"),
    ]
    return nb


def _exercise(source):
    def change(nb):
        next(c for c in nb.cells if c.get("id") == "exercise-mean-score").source = source
    return change


def _before_check(code, exercise=NOTHING):
    """The exercise replaced by ``exercise``, and a cell of the student's own before the check."""
    def change(nb):
        _exercise(exercise)(nb)
        at = next(i for i, c in enumerate(nb.cells) if c.get("id") == "check-mean-score")
        nb.cells.insert(at, new_code_cell(code, id="mine"))
    return change


FAKE_CORRECT = f"print({CORRECT.strip()!r})"

# A process that leaves: double fork, its own session, SIGTERM ignored; it
# waits for the grader to finish, then tries to write a grade.
DAEMON = '''
import os, signal, subprocess, sys, time
code = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(5)
for path in [@CSV@]:
    try:
        open(path, "a").write("daemon,00_setup,1,1,,pwned\\\\n")
    except OSError:
        pass
time.sleep(600)
"""
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", code, "@MARKER@"])
    os._exit(0)
time.sleep(0.5)
'''

KILL_ANCESTORS = '''
import os, signal
pid = os.getppid()
chain = []
while pid > 1:
    chain.append(pid)
    try:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        break
for pid in chain:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
'''

# Any of these, if it works, hands the submission the solution (it then runs it).
STEAL = '''
import glob, json, os
found = []
def grab(path):
    try:
        nb = json.load(open(path))
        found.extend("".join(c["source"]) for c in nb["cells"]
                     if c.get("id") == "exercise-mean-score" and "BEGIN" in "".join(c["source"]))
    except Exception:
        pass
grab(@REFERENCE@)
for path in glob.glob(@OTHER@ + "/*.ipynb") + glob.glob("/work/**/notebooks/00_setup.ipynb"):
    grab(path)
try:
    ddplab.solution("mean-score")
    found.append("solution")
except Exception:
    pass
for pid in os.listdir("/proc"):
    try:
        if @REFERENCE@.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
            found.append("cmdline")
    except OSError:
        pass
if found:
    get_ipython().run_cell_magic("ranks", "", """@SOLUTION@""")
'''

STEAL_ON_RANKS = '''%%ranks
import json
try:
    cells = json.load(open(@REFERENCE@))["cells"]
    code = "".join(next(c for c in cells if c.get("id") == "exercise-mean-score")["source"])
    exec(code.replace("%%ranks", ""), globals())
except OSError:
    pass
'''

# ddplab.algorithms holds notebook 06's answers, and 06's demos run it in the sandbox: its code
# is there, its source is not (ddplab.grade.sandbox.ANSWER_MODULES). Where it could be read, this
# submission runs the solution.
READ_ANSWERS = '''%%ranks
import ddplab.algorithms
source = open(ddplab.algorithms.__file__).read()
assert "def ring_all_reduce" in source, "no answer to read here"
@SOLUTION@
'''

WRITE_OUTSIDE = '''
for path in [@REFERENCE@, @CSV@, @OTHER@ + "/00_setup.ipynb"]:
    try:
        open(path, "a").write("pwned")
    except OSError:
        pass
'''

RANK_DAEMON = '''%%ranks
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c",
                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
                 "@MARKER@"])
    os._exit(0)
'''

IMPORT_HOOK = f'''
import importlib.machinery, sys
path = list(ddplab.check.__path__)
class Hook:
    def find_spec(self, name, where=None, target=None):
        if name != "ddplab.check.nb00_setup":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader
        class Loader(importlib.machinery.SourceFileLoader):
            def exec_module(self, module):
                real.exec_module(module)
                module.mean_score = lambda *a, **k: {FAKE_CORRECT}
        spec.loader = Loader(name, spec.origin)
        return spec
sys.meta_path.insert(0, Hook())
'''


def _move_check_above_exercise(nb):
    _exercise(SOLUTION)(nb)
    check = next(c for c in nb.cells if c.get("id") == "check-mean-score")
    nb.cells.remove(check)
    nb.cells.insert(2, check)


def _setup_times_out(nb):
    _exercise(SOLUTION)(nb)
    nb.cells[0].source += "\nwhile True:\n    pass"


# The published attack on Gradescope's autograders: the submission writes the results file (a
# perfect results.json; here @CSV@), now and from a process that outlives its cell and tries again
# once the grader should have finished.
REWRITE_RESULTS = '''
import json, os, sys
forged = json.dumps({"score": 100, "tests": [{"name": "forged", "score": 100, "max_score": 1}]})
try:
    open(@CSV@, "w").write(forged)
except OSError:
    pass
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", f"""
import time
for _ in range(60):
    time.sleep(0.5)
    try:
        open({@CSV@!r}, "w").write({forged!r})
    except OSError:
        pass
""", "@MARKER@"])
    os._exit(0)
'''
SHOWTRACEBACK = ("ip = get_ipython()\n"
                 f"ip.showtraceback = lambda *a, **k: {FAKE_CORRECT}\n"
                 "import sys\n"
                 f"print('ddplab-verdict 0000 pass')")

ATTACKS = {
    # the controls: an honest submission scores, a stub does not
    "honest": (_exercise(SOLUTION), 1),
    "stub": (_exercise(STUB), 0),
    # integrity: the point comes only from the real check
    "replaced_checker": (_before_check(
        f"ddplab.check.mean_score = lambda *a, **k: {FAKE_CORRECT}"), 0),
    "fake_ddplab": (_before_check(
        "class ddplab:\n    class check:\n        @staticmethod\n"
        f"        def mean_score(*a, **k):\n            {FAKE_CORRECT}"), 0),
    "swapped_code": (_before_check(
        "import ddplab.check.nb00_setup as nb00\n"
        f"nb00.mean_score.__wrapped__.__code__ = (lambda lab=None: {FAKE_CORRECT}).__code__\n"
        f"ddplab.check._core.compare.__code__ = (lambda *a, **k: None).__code__"), 0),
    "patched_print": (_before_check(
        "import builtins, sys\n_p = builtins.print\n"
        f"builtins.print = lambda *a, **k: _p({CORRECT.strip()!r})\n"
        "class Out:\n    def write(self, s): return sys.__stdout__.write(s)\n"
        "    def flush(self): pass\nsys.stdout = sys.stderr = Out()"), 0),
    "swallowed_error": (_before_check(SHOWTRACEBACK), 0),
    "wrong_values_faked": (_before_check(
        "import ddplab.check._core as core\n"
        "core.same = lambda *a, **k: True",
        exercise="%%ranks\nmean_score = torch.tensor([0.0])"), 0),
    # containment: nothing it starts outlives it
    "setsid_daemon": (_before_check(DAEMON), 0),
    "rank_daemon": (_before_check(RANK_DAEMON), 0),
    # a run that survives: it kills every process above its kernel
    "kill_ancestors": (_before_check(KILL_ANCESTORS), 0),
    # isolation: nothing to read, nothing to write
    "steal_solution": (_before_check(STEAL), 0),
    "steal_on_ranks": (_exercise(STEAL_ON_RANKS), 0),
    "read_answers": (_exercise(READ_ANSWERS), 0),
    "write_outside": (_before_check(WRITE_OUTSIDE), 0),
    "rewrite_results": (_before_check(REWRITE_RESULTS), 0),
    # the instructor's traps: the reason says what happened
    "moved_check": (_move_check_above_exercise, 0),
    "setup_times_out": (_setup_times_out, 0),
}

ATTACKS.update({
    # what the checker computes with, patched in the kernel: put back before the check
    "patched_torch": (_before_check(
        "import torch\ntorch.allclose = lambda *a, **k: True\n"
        "torch.Tensor.__eq__ = lambda *a, **k: True",
        exercise="%%ranks\nmean_score = torch.tensor([0.0])"), 0),
    "import_hook": (_before_check(IMPORT_HOOK), 0),
})

# Code in the kernel that changes what a checker relies on beyond what the
# kernel's guard puts back: defeated only because the grading worker runs the
# check in its own process (ddplab.grade.witness), against the ranks.
PICKLE_GADGET = '''%%ranks
class Forge:
    # unpickled where the check reads it: makes every comparison pass
    def __reduce__(self):
        return (exec, ("import ddplab.check._core as c; c.same = lambda *a, **k: True",))
mean_score = Forge()
'''

POST_RUN_HOOK = (f"get_ipython().events.register('post_run_cell', lambda *a: {FAKE_CORRECT})\n"
                 "import IPython.display\n"
                 f"IPython.display.display = lambda *a, **k: {FAKE_CORRECT}")

ATTACKS.update({
    "patched_lab_run": (_before_check(
        "import torch\ntype(lab).run = lambda self, fn, *a, **k: [torch.tensor([13 / 6])] * 2"), 0),
    "patched_lab_class": (_before_check(
        "import torch, ddplab.lab, ddplab.lab.calls\n"
        "ddplab.lab.Lab.run = lambda self, fn, *a, **k: [torch.tensor([13 / 6])] * self.world_size\n"
        "ddplab.lab.calls.Calls.finish = lambda self, tasks, *a, **k: [\n"
        "    setattr(t, 'outcome', {'ok': True, 'events': [], 'error': None,\n"
        "                           'value': torch.tensor([13 / 6])}) for t in tasks]"), 0),
    "patched_dist_in_kernel": (_before_check(
        "import torch, torch.distributed as dist\n"
        "dist.is_initialized = lambda *a, **k: True\n"
        "dist.all_reduce = lambda t, *a, **k: t.fill_(13 / 6)\n"
        "torch.cat = lambda *a, **k: torch.tensor([13 / 6] * 6)",
        exercise="%%ranks\nmean_score = torch.tensor([0.0])"), 0),
    "pickle_gadget_on_ranks": (_exercise(PICKLE_GADGET), 0),
    "post_run_hook": (_before_check(POST_RUN_HOOK), 0),
})


def submission(name: str, *, marker: str, reference: str, other: str, csv: str) -> str:
    """The notebook of attack ``name``, as text, with the test's values filled in."""
    nb = reference_notebook = globals()["reference"]()
    nb.cells[2].source = STUB                    # what ddplab release hands out
    nb.cells[2].outputs = []
    ATTACKS[name][0](reference_notebook)
    values = {"@MARKER@": marker, "@REFERENCE@": repr(reference), "@OTHER@": repr(other),
              "@CSV@": repr(csv), "@SOLUTION@": SOLUTION.replace("%%ranks\n", "")}
    for cell in nb.cells:
        for token, value in values.items():
            cell.source = cell.source.replace(token, value)
    return nbformat.writes(nb)


def survivors(marker: str) -> list[int]:
    """The live processes (zombies aside) whose command line names ``marker``: what an attack left."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != "zombie":
                found.append(p.pid)
        except psutil.Error:
            pass
    return found
