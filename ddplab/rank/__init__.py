"""Code that runs inside the lab's processes, not in the notebook kernel.

- ``engine``: runs a cell or function on a rank, records its output in order,
  joins and leaves the process group, dumps a stuck rank's stack.
- ``fdcapture``: routes what the rank writes to fd 1 and 2 (subprocesses,
  ``os.write``, gloo's and NCCL's C++ logs) into the same recorder as ``print``.
- ``trace``: while ``lab.trace()`` runs, records this rank's torch.distributed
  operations (Python calls and the c10d ops torch issues itself, DDP's included).
- ``where``: where a rank is, from its stack: the torch.distributed call it
  waits in and the user's line (``all_reduce``, ``cell line 3``), in one
  wording for the live status (``blocked``), the hang report
  (``ddplab.lab.diagnose``) and the trace (``recorder``).
- ``tether``: the wrapper every controller and engine process runs under
  (``python -m ddplab.rank.tether MODULE``); it exits when the kernel dies.

The kernel ships calls to these modules through ipyparallel; nothing here
imports the kernel-side ``ddplab.lab``.
"""
