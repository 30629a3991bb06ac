"""``procs.reap_adopted``: a child subreaper reaps the orphans it adopts, never its own children.

``ddplab grade`` is a child subreaper: bubblewrap's own child, orphaned when the outer ``bwrap``
exits, was left a zombie per sandboxed submission until the grader exited (issue 42).
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r'''
import json, os, time, psutil
from ddplab import procs

procs.become_subreaper()
# An orphan: the shell starts a child in the background and exits; the child is handed to us. It
# ends only once the shell is gone (reaped), so it cannot end, and be reaped, while the shell
# still is its parent (a `true &` that ended first was the shell's to reap, now and then).
shell = procs.start(["sh", "-c", "(while kill -0 $$ 2>/dev/null; do sleep 0.01; done) & echo $!"],
                    stdout=__import__("subprocess").PIPE, text=True)
orphan = int(shell.stdout.readline())
shell.wait()
# One of our own, exited and not yet waited for: its Popen must keep its exit status.
own = procs.start([os.sys.executable, "-c", "raise SystemExit(3)"])
deadline = time.monotonic() + 30
def zombie(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
while not (zombie(orphan) and zombie(own.pid)) and time.monotonic() < deadline:
    time.sleep(0.01)
reaped = procs.reap_adopted()
print(json.dumps({"orphan": orphan, "reaped": reaped, "own_code": own.wait(timeout=10),
                  "left": [p.pid for p in psutil.Process().children()]}))
'''


def test_adopted_zombies_are_reaped_and_our_own_children_keep_their_exit_status():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["reaped"] == [seen["orphan"]]
    assert seen["own_code"] == 3
    assert seen["left"] == []
