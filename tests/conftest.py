"""Shared fixtures: real engines, real gloo. One 2-rank lab serves most tests.

Every test runs under the leak check (``leakcheck``): the suite has a temporary
folder of its own, and a test, module or notebook that leaves a ``ddplab-*``
entry there, or a live process, fails at its teardown, named. The check is a
plugin of the whole run, so the notebooks that nbval runs beside the tests
(``make test``) are checked too. No ``conftest.py`` sits beside the notebooks
or at the top: pytest keeps one module named ``conftest`` at a time, and the
tests, and the ranks that import a test's module, must find this one.
"""

from __future__ import annotations

from pathlib import Path

import leakcheck
import nbformat
import psutil
import pytest
from browserkit import require_chromium
from kernelkit import ok
from leakcheck import lab_dirs, my_process_tree  # noqa: F401  tests import them from here
from realhosts import *  # noqa: F401,F403  the realhosts tier's daemons (tests/realhosts.py)

import ddplab


def pytest_configure(config) -> None:
    leakcheck.install(config)


def pytest_collection_modifyitems(items) -> None:
    """Tests on the network-namespace hosts are the ``netns`` tier (root and iproute2); the
    notebooks that nbval runs are the ``course`` tier, with the modules that grade them."""
    for item in items:
        if "hosts_lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.netns)
        if str(item.path).endswith(".ipynb"):
            item.add_marker(pytest.mark.course)
    _send_test_modules_by_value(items)


def _send_test_modules_by_value(items) -> None:
    """The functions a test sends to the ranks travel as a notebook cell's do: by value.

    ddplab sends a function of an importable module by name (``ddplab.lab.shipping``)
    and each rank imports the module; for a test module that means pytest, this
    conftest and the suite's helpers, seconds on a fresh rank of a loaded machine,
    inside the timeout a test may be measuring. What tests send stands for a
    student's notebook functions; tests/test_fresh.py sends real modules' by name.
    """
    import cloudpickle

    for module in {item.module for item in items if isinstance(item, pytest.Function)}:
        if module.__name__.startswith("test_"):
            cloudpickle.register_pickle_by_value(module)


@pytest.fixture
def chromium() -> str:
    """The path of Debian's Chromium; skip (by hand) or fail (make test, CI) without it."""
    return require_chromium()


@pytest.fixture(scope="session")
def shell():
    """IPython's one test shell (a second ``start_ipython()`` returns None), ddplab's magics loaded."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or get_ipython()
    shell.run_line_magic("load_ext", "ddplab")
    shell.run_cell("import ddplab")
    return shell


def cell_error(shell, source: str) -> BaseException | None:
    """Run ``source`` as a cell of ``shell``; the exception it raised, or None."""
    result = shell.run_cell(source)
    return result.error_in_exec or result.error_before_exec


@pytest.fixture(scope="session")
def lab():
    """A running 2-rank gloo lab, restarted if a test left it broken."""
    with ddplab.start(world_size=2, backend="gloo", timeout=30) as lab:
        yield lab


def _usable_and_current(lab):
    """``lab``, restarted if an earlier test broke it, and made current (checkers and
    ``ddplab.show`` find it): what ``fresh_lab`` and ``fresh_lab4`` give a test."""
    if not lab.healthy:
        lab.restart()
    ddplab.lab.current_lab.make_current(lab)
    return lab


@pytest.fixture
def fresh_lab(lab):
    """The session lab, guaranteed usable: restarted if an earlier test broke it."""
    return _usable_and_current(lab)


@pytest.fixture(scope="module")
def lab_kernel():
    """A Jupyter kernel started with jupyter_client, ``lab`` a running 2-rank gloo lab in it:
    what tests/test_debugger_*.py and tests/test_live_output.py drive as a front end would (one
    definition for all; ``k`` below, and test_live_output's own fixture, restart the lab if it
    is broken).
    ``client.interrupt`` is Kernel > Interrupt.

    Per module, not per session: a kernel listens on 127.0.0.1 (Jupyter's ZMQ channels), and
    tests/test_reliability.py asserts that nothing under the test run listens on this machine's
    network while a lab runs; a session kernel would still be there.
    """
    import sys

    from jupyter_client.manager import start_new_kernel

    def ok(client, code: str) -> None:
        reply = client.execute_interactive(code, timeout=180, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=120)
    try:
        ok(client, f"import sys; assert sys.executable == {sys.executable!r}")
        ok(client, "import ddplab\nlab = ddplab.start(world_size=2, backend='gloo', timeout=30)")
        client.interrupt = manager.interrupt_kernel
        yield client
        ok(client, "lab.stop()")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.fixture
def k(lab_kernel):
    """The module's kernel (``lab_kernel``), its lab usable (an earlier test may have left it to
    restart): what tests/test_debugger_*.py run their cells on (tests/kernelkit.py)."""
    ok(lab_kernel, "if not lab.healthy: lab.restart()")
    return lab_kernel


def side_lab(world_size: int = 2, *, timeout: float = 60, grace: float = 2.0,
             pg_timeout: float = 1800, init_method: str | None = "store", start: bool = True):
    """A local CPU (gloo) lab beside the session's labs: ``ddplab.start`` would replace the
    2-rank one. Started unless ``start=False``; the caller stops it."""
    from ddplab.lab import Lab, LabSpec

    lab = Lab(LabSpec(world_size=world_size, backend="gloo", timeout=timeout, grace=grace,
                      pg_timeout=pg_timeout, debug=False, init_method=init_method), gpus=0)
    return lab.start() if start else lab


@pytest.fixture(scope="session")
def lab4():
    """A running 4-rank gloo lab, beside the 2-rank one (start() would replace that one)."""
    lab = side_lab(4)
    yield lab
    lab.stop()


@pytest.fixture
def fresh_lab4(lab4):
    """The 4-rank lab, usable and current, so checkers and ddplab.show find it."""
    return _usable_and_current(lab4)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """Every TCP (ip, port) listening in the network namespace of process ``pid``.

    Read from ``/proc/PID/net/tcp``, which shows that process's network, not
    ours: how a test sees into a lab's private network (ddplab.rank.netns).
    """
    import ipaddress
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)                                   # the header
            for line in f:
                local, state = line.split()[1], line.split()[3]
                if state != "0A":                     # TCP_LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)
                # The kernel prints the address as 32-bit words in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def fails(checker, *needles: str) -> str:
    """Run a checker that must reject the answer; return its message after checking key words.

    Every rejection is the one kind of feedback (``ddplab.check.Feedback``), whose text has no
    Python traceback in it: the student's own frames at most, never a stack of ddplab's."""
    with pytest.raises(ddplab.check.Feedback) as info:
        checker()
    message = str(info.value)
    assert "Traceback (most recent call last)" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def last_line(capsys) -> str:
    """The last line a checker printed (its one ``Correct: ...`` line)."""
    return capsys.readouterr().out.splitlines()[-1]


def tiny_course(folder: Path, exercise_source: str) -> tuple[Path, Path]:
    """A one-exercise reference (its check prints ok), and a submission with ``exercise_source``."""
    def notebook(source: str):
        nb = nbformat.v4.new_notebook()
        ok = nbformat.v4.new_output("stream", name="stdout", text="ok\n")
        nb.cells = [nbformat.v4.new_code_cell(source, id="exercise-loud",
                                              metadata={"tags": ["exercise"]}),
                    nbformat.v4.new_code_cell("print('ok')", id="check-loud",
                                              metadata={"tags": ["check"]}, outputs=[ok])]
        return nb
    (folder / "ref").mkdir()
    (folder / "sub" / "mallory").mkdir(parents=True)
    nbformat.write(notebook("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"), folder / "ref" / "loud.ipynb")
    nbformat.write(notebook(exercise_source), folder / "sub" / "mallory" / "loud.ipynb")
    return folder / "ref", folder / "sub"
