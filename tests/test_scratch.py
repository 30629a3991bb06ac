"""ddplab.scratch_folder: every rank uses it, it outlives restarts, it goes with the last lab or kernel."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
import time

import pytest

import ddplab
from ddplab import procs


def _write(folder: str) -> None:
    import torch.distributed as dist
    with open(os.path.join(folder, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write("here")


def test_every_rank_writes_there_and_it_outlives_a_restart(fresh_lab):
    folder = ddplab.scratch_folder("t")
    try:
        assert os.path.basename(folder).startswith("ddplab-t-")
        assert os.path.dirname(folder) != tempfile.gettempdir(), "inside the template's directory"
        assert os.stat(folder).st_mode & 0o777 == 0o700
        fresh_lab.run(_write, folder)
        fresh_lab.restart()
        assert sorted(os.listdir(folder)) == ["rank0.txt", "rank1.txt"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


KERNEL = """
import os, ddplab
lab = ddplab.start(world_size=2, backend="gloo", timeout=60)
first = ddplab.scratch_folder("a")
lab.stop()
print("after stop:", os.path.exists(first), flush=True)
lab = ddplab.start(world_size=2, backend="gloo", timeout=60)
second = ddplab.scratch_folder("b")
print("second:", second, flush=True)
os._exit(0)          # as kill -9: no atexit, no lab.stop()
"""


@pytest.mark.slow
def test_it_goes_with_the_last_lab_stop_and_with_a_dead_kernel():
    ran = procs.run([[sys.executable, "-c", textwrap.dedent(KERNEL)]], 240)
    out = ran[0].output
    assert "after stop: False" in out, out
    second = out.split("second: ")[1].split()[0]
    deadline = time.monotonic() + 15
    while os.path.exists(second) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(second), f"the dead kernel's scratch folder is still there: {second}"


@pytest.mark.parametrize("name", ["a/b", "../../x", "x" * 300, "..", "", "a b"])
def test_a_name_that_is_not_one_folder_name_is_a_config_error(name):
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(ddplab.ConfigError, match=r"name must be one short word for a folder "
                                                 r"name: letters, digits, '-', '_' or '\.', 1 to "
                                                 r"64 of them \(not only dots\)") as info:
        ddplab.scratch_folder(name)
    assert "never a path: use e.g. scratch_folder('nb10')" in str(info.value)
    if len(name) > 64:
        assert f"({len(name)} characters)" in str(info.value) and name not in str(info.value)
    assert set(os.listdir(tempfile.gettempdir())) <= before       # nothing made
