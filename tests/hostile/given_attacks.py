"""Attacks on checks given something from the notebook, for ``tests/test_grade_hostile.py``.

The audit of issue 27 forged these: a check cell that passes the checker the
student's function (``ddplab.check.swap_tensors(swap)``) or answer
(``ddplab.check.who_waited(waited)``) used to run in the submission's kernel,
where one cell (``def exec(...): print("Correct ...")``) earned the point. The
reference here is notebook 01's two exercises of that kind: ``swap``
(a function the checker runs on the ranks) and ``who-waited`` (a value read
off the timeline of a traced cell). Every attack hands in ``swap`` as the
release stub and a wrong ``waited``, then tries to pass both checks anyway;
it deserves 0 of 2. ``ATTACKS`` maps a name to (what it does to the notebook,
the score it deserves), as in ``attacks.py``.
"""

from __future__ import annotations

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

NOTEBOOK = "01_given.ipynb"
SWAP_CORRECT = "Correct: each rank returned the other rank's tensor and kept its own.\n"
WAITED_CORRECT = "Correct: send on rank 0 waited longest, for the other rank.\n"
SWAP = '''def swap(t):
    ### BEGIN SOLUTION
    other = 1 - dist.get_rank()
    received = torch.empty_like(t)
    requests = [dist.isend(t, dst=other), dist.irecv(received, src=other)]
    for request in requests:
        request.wait()
    return received
    ### END SOLUTION'''
SWAP_STUB = "def swap(t):\n    # YOUR CODE HERE\n    raise NotImplementedError()"
WAITED = '### BEGIN SOLUTION\nwaited = (0, "send")\n### END SOLUTION'
WAITED_WRONG = 'waited = (1, "recv")'
TRACED = '''%%ranks --trace
import time
t = torch.arange(4.0)
dist.barrier()
if rank == 0:
    dist.send(t, dst=1)                 # waits for rank 1's recv
else:
    time.sleep(1.0)
    dist.recv(t, src=0)'''


def reference():
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    out = lambda text: [new_output("stream", name="stdout", text=text)]   # noqa: E731
    nb.cells = [
        new_code_cell("# NBVAL_IGNORE_OUTPUT\nimport torch\nimport torch.distributed as dist\n"
                      "import ddplab\nlab = ddplab.start(world_size=2)", id="setup"),
        new_code_cell(SWAP, id="exercise-swap", metadata={"tags": ["exercise"]}),
        new_code_cell("ddplab.check.swap_tensors(swap)", id="check-swap",
                      metadata={"tags": ["check"]}, outputs=out(SWAP_CORRECT)),
        new_code_cell(TRACED, id="traced"),
        new_code_cell(WAITED, id="exercise-who-waited", metadata={"tags": ["exercise"]}),
        new_code_cell("ddplab.check.who_waited(waited)", id="check-who-waited",
                      metadata={"tags": ["check"]}, outputs=out(WAITED_CORRECT)),
        new_code_cell("lab.stop()", id="stop"),
    ]
    return nb


def _answers(swap: str, waited: str):
    def change(nb):
        cells = {c.get("id"): c for c in nb.cells}
        cells["exercise-swap"].source, cells["exercise-who-waited"].source = swap, waited
    return change


def _before_checks(code: str, check: str = "check-swap"):
    """Both exercises wrong, and a cell of the student's own before ``check`` (the first)."""
    def change(nb):
        _answers(SWAP_STUB, WAITED_WRONG)(nb)
        at = next(i for i, c in enumerate(nb.cells) if c.get("id") == check)
        nb.cells.insert(at, new_code_cell(code, id="mine"))
    return change


def _by_cell(what: str) -> str:
    """Python that prints the right Correct line for the check cell whose source is ``what``."""
    return f"({SWAP_CORRECT.strip()!r} if 'swap' in str({what}) else {WAITED_CORRECT.strip()!r})"


# The audit's forgery: the kernel's guard ran `exec(compile(...), dict(...))` in the
# notebook's namespace, where these names are the submission's.
SHADOWED_BUILTINS = f'''
def exec(source, *a, **k):
    print{_by_cell("source")}
def compile(source, *a, **k):
    return source
'''

PATCHED_LAB_RUN = '''
import ddplab.lab, ddplab.check.nb01_point_to_point as p2p
def run(self, fn, *args, **kwargs):
    # what swap_tensors expects back from the ranks, for the trial it asks for
    case = args[-1]
    return [[p2p.sample(case, 1 - r), p2p.sample(case, r)] for r in range(2)]
type(lab).run = ddplab.lab.Lab.run = run
'''

REPLACED_CHECKERS = f'''
ddplab.check.swap_tensors = lambda *a, **k: print({SWAP_CORRECT.strip()!r})
ddplab.check.who_waited = lambda *a, **k: print({WAITED_CORRECT.strip()!r})
setattr(ddplab.check.nb01_point_to_point, "swap_tensors", ddplab.check.swap_tensors)
'''

FAKE_DDPLAB = f'''
class ddplab:
    class check:
        swap_tensors = staticmethod(lambda *a, **k: print({SWAP_CORRECT.strip()!r}))
        who_waited = staticmethod(lambda *a, **k: print({WAITED_CORRECT.strip()!r}))
'''

SWAPPED_CODE = f'''
import ddplab.check.nb01_point_to_point as p2p
fake_swap = lambda fn, lab=None, timeout=0: print({SWAP_CORRECT.strip()!r})
fake_waited = lambda answer, trace=None: print({WAITED_CORRECT.strip()!r})
p2p.swap_tensors.__wrapped__.__code__ = fake_swap.__code__      # the checker under @checker
p2p.who_waited.__wrapped__.__code__ = fake_waited.__code__
'''

# Every print in the kernel is followed by both Correct lines, and so is every cell.
BOTH = repr(SWAP_CORRECT + WAITED_CORRECT)
PRINTED_CORRECT = f'''
import builtins, IPython.display
_print = builtins.print
builtins.print = lambda *a, **k: (_print(*a, **k), _print({BOTH}, end=""))[-1]
get_ipython().events.register("post_run_cell", lambda result: _print{_by_cell("result.info.raw_cell")})
IPython.display.display = lambda *a, **k: _print({BOTH}, end="")
'''

PATCHED_STDOUT = f'''
import sys
class Out:
    def __init__(self, real):
        self.real = real
    def write(self, s):
        return self.real.write(s + ({BOTH} if s.endswith("\\n") else ""))
    def flush(self):
        self.real.flush()
sys.stdout, sys.stderr = Out(sys.stdout), Out(sys.stderr)
print("ddplab-verdict 0000 pass")
'''

PATCHED_TORCH_IN_KERNEL = '''
import torch, torch.distributed as dist
dist.isend = dist.irecv = lambda *a, **k: None
dist.is_initialized = lambda *a, **k: True
torch.equal = torch.allclose = lambda *a, **k: True
torch.Tensor.__eq__ = lambda *a, **k: True
'''

# Unpickled where a check reads `waited`, it would make every comparison pass.
GADGET_ANSWER = '''
class Forge:
    def __reduce__(self):
        return (exec, ("import ddplab.check._core as c; c.same = lambda *a, **k: True",))
waited = Forge()
'''

ATTACKS = {
    "given_honest": (_answers(SWAP, 'waited = (0, "send")'), 2),
    "given_stub": (_answers(SWAP_STUB, WAITED_WRONG), 0),
    "given_shadowed_exec": (_before_checks(SHADOWED_BUILTINS), 0),
    "given_patched_lab_run": (_before_checks(PATCHED_LAB_RUN), 0),
    "given_replaced_checkers": (_before_checks(REPLACED_CHECKERS), 0),
    "given_fake_ddplab": (_before_checks(FAKE_DDPLAB), 0),
    "given_swapped_code": (_before_checks(SWAPPED_CODE), 0),
    "given_printed_correct": (_before_checks(PRINTED_CORRECT), 0),
    "given_patched_stdout": (_before_checks(PATCHED_STDOUT), 0),
    "given_patched_torch": (_before_checks(PATCHED_TORCH_IN_KERNEL), 0),
    "given_gadget_answer": (_before_checks(GADGET_ANSWER, "check-who-waited"), 0),
}


def submission(name: str) -> str:
    """The notebook of attack ``name``, as text: the released notebook, changed by the attack."""
    nb = reference()
    for cell in nb.cells:
        if cell.get("id", "").startswith("exercise-"):
            cell.source = "# YOUR CODE HERE\nraise NotImplementedError()"
        if "check" in cell.metadata.get("tags", []):
            continue
        cell.outputs = []
    ATTACKS[name][0](nb)
    return nbformat.writes(nb)
