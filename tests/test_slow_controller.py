"""A lab starts even when its controller answers the engines' registration late (issue 42: under
a load average of 4, a 4-rank start once timed out with 3 of 4 engines ready after 60 s).

ipyparallel's engine waits ``IPEngine.timeout`` (5 s by default) for the controller's reply to
its registration, then exits for good ("Registration timed out after 5.0 seconds"), and the
start waited for it until its own 60 s ran out. The controller writes the file the engines
wait for, then starts its schedulers before it answers anyone: on a loaded machine that took
longer than 5 s. Here the controller is stopped (SIGSTOP) from the moment it writes that file
until every engine has waited 6 s for its answer."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import ipyparallel as ipp
import pytest
from conftest import side_lab

from ddplab import procs

pytestmark = pytest.mark.slow

#: How long each engine waits for the stopped controller: longer than ipyparallel's 5 s.
WAITED_S = 6


def test_engines_wait_for_a_controller_that_answers_late(monkeypatch):
    real = ipp.Cluster.start_engines
    waited = []

    async def start_engines_with_a_late_controller(self, *args, **kwargs):
        controller, folder = procs.process(self.controller.process.pid), self.profile_dir
        engine_file = os.path.join(folder, "security", f"ipcontroller-{self.cluster_id}-engine.json")

        def registering() -> int:
            return sum("Registering with controller" in open(log).read()
                       for log in glob.glob(os.path.join(folder, "log", "ipengine-*.log")))

        def stop_until_every_engine_waited() -> None:
            while not os.path.exists(engine_file):
                time.sleep(0.001)
            procs.send(controller, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 60
                while registering() < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(WAITED_S)
                waited.append(registering())
            finally:
                procs.send(controller, signal.SIGCONT)

        threading.Thread(target=stop_until_every_engine_waited, daemon=True).start()
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(ipp.Cluster, "start_engines", start_engines_with_a_late_controller)
    lab = side_lab(2)     # before: TimeoutError "2 engines not ready in 60 seconds", after 60 s
    try:
        assert waited == [2], "the engines did not register while the controller was stopped"
        assert len(set(lab.run(os.getpid))) == 2
    finally:
        lab.stop()
