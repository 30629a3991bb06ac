"""The default rendezvous is private: a FileStore in the lab's owner-only directory.

On a shared machine (a JupyterHub node) every user shares 127.0.0.1, so a
TCPStore on loopback could be listed and written by anyone. A local lab's
default ``init_method="store"`` meets in a file instead; these tests try to
reach that file as a second Unix user (``nobody``) and check that it goes
with the lab.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest
from conftest import side_lab

#: Run as another user; only the standard library, so any python3 will do.
TRY_THE_STORE = """
import json, os, sys
path = sys.argv[1]
tries = {"read the store": lambda: open(path, "rb").read(),
         "write the store": lambda: open(path, "ab").write(b"key"),
         "list the lab's directory": lambda: os.listdir(os.path.dirname(path))}
outcome = {}
for what, attempt in tries.items():
    try:
        attempt()
        outcome[what] = "allowed"
    except PermissionError:
        outcome[what] = "permission denied"
    except OSError as e:
        outcome[what] = f"{type(e).__name__}: {e}"
print(json.dumps(outcome))
"""


def _as_nobody(code: str, *args: str) -> dict:
    """Run ``code`` as the user ``nobody`` and return the JSON it prints; skip if we cannot."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a snippet as a second user (nobody); "
                    "the mode checks in this file still run")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux) to run a snippet as a second user")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user 'nobody'")
    become = [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
    # The venv's python may sit where nobody cannot read; the system one needs only the stdlib.
    for python in (sys.executable, "/usr/bin/python3"):
        if subprocess.run(become + [python, "-c", "pass"], capture_output=True,
                          timeout=60).returncode == 0:
            done = subprocess.run(become + [python, "-c", code, *args], capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)
    pytest.skip("no python that the user nobody may run")


def _default_store():
    """On a rank: what the default group meets in, and the torchrun variables it was given."""
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    store = distributed_c10d._get_default_store()          # a PrefixStore("default_pg", ...)
    underlying = store.underlying_store
    return {"store": type(underlying).__name__, "path": getattr(underlying, "path", None),
            "rank": dist.get_rank(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                   "MASTER_PORT")}}


def _groups_and_barriers():
    """On a rank: what relies on the default store after init: new groups and barriers."""
    import torch
    import torch.distributed as dist
    pair = dist.new_group([0, 1])
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=pair)
    dist.barrier()
    dist.monitored_barrier()             # gloo only; its own keys live in the store too
    return t.item()


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_default_local_lab_meets_in_a_file_store_not_a_tcpstore(fresh_lab):
    assert fresh_lab.spec.init_method == "store"
    facts = fresh_lab.run(_default_store)
    assert [f["store"] for f in facts] == ["FileStore", "FileStore"]   # no TCPStore anywhere
    assert {f["path"] for f in facts} == {fresh_lab.store_path}
    # Nobody listens, so no MASTER_ADDR / MASTER_PORT pointing at nothing.
    for rank, fact in enumerate(facts):
        assert fact["env"] == {"RANK": str(rank), "WORLD_SIZE": "2",
                               "MASTER_ADDR": None, "MASTER_PORT": None}
    assert fresh_lab.run(_groups_and_barriers) == [3.0, 3.0]


def test_the_store_is_owner_only(fresh_lab):
    path = fresh_lab.store_path
    assert os.path.basename(path).startswith("store-")
    assert os.path.dirname(path) == fresh_lab.directory
    assert os.stat(path).st_uid == os.stat(os.path.dirname(path)).st_uid == os.getuid()
    assert _mode(path) == 0o600
    assert _mode(os.path.dirname(path)) == 0o700


def test_another_user_cannot_reach_the_store(fresh_lab):
    # The control first: the same snippet, as the same user, reads a world-readable
    # file, so a "permission denied" below comes from the modes, not from the harness.
    with tempfile.TemporaryDirectory() as open_dir:
        os.chmod(open_dir, 0o755)
        readable = os.path.join(open_dir, "readable")
        with open(readable, "w") as f:
            f.write("x")
        os.chmod(readable, 0o644)
        control = _as_nobody(TRY_THE_STORE, readable)
    assert control["read the store"] == "allowed", control
    assert control["list the lab's directory"] == "allowed", control

    denied = _as_nobody(TRY_THE_STORE, fresh_lab.store_path)
    assert denied == {"read the store": "permission denied",
                      "write the store": "permission denied",
                      "list the lab's directory": "permission denied"}
    assert fresh_lab.run(_groups_and_barriers) == [3.0, 3.0]      # and the lab is untouched


def test_the_controllers_signing_key_is_in_the_private_directory(fresh_lab):
    # The controller is on Unix sockets in the lab's 0700 directory, and every message
    # must also be signed with this key, which no other user can read.
    files = sorted(glob.glob(os.path.join(fresh_lab.directory, "security", "ipcontroller-*.json")))
    assert [os.path.basename(f) for f in files] == ["ipcontroller-lab-client.json",
                                                    "ipcontroller-lab-engine.json"]
    for path in files:
        with open(path) as f:
            info = json.load(f)
        assert info["signature_scheme"] == "hmac-sha256" and len(info["key"]) >= 32, path
        assert info["interface"] == f"ipc://{fresh_lab.directory}/c", path
        assert _mode(path) == 0o600, path


@pytest.mark.slow
def test_restart_gets_a_fresh_store_and_stop_leaves_nothing_behind():
    lab = side_lab(2)
    try:
        first, directory = lab.store_path, lab.directory
        assert os.path.basename(first) == "store-1"
        lab.restart()                    # keeps the controller, replaces the engines
        second = lab.store_path
        assert os.path.basename(second) == "store-2"
        assert not os.path.exists(first)             # a reused store would deadlock
        assert _mode(second) == 0o600
        assert {f["path"] for f in lab.run(_default_store)} == {second}
        assert lab.run(_groups_and_barriers) == [3.0, 3.0]
    finally:
        lab.stop()
    assert not os.path.exists(second)
    assert not os.path.exists(directory)             # the whole private directory went
