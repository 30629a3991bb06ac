"""Live progress: report() on the ranks, the ProgressBars the lab feeds in the kernel (ddplab.lab.bars)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from ddplab import progress
from ddplab.lab import bars, channel


class Result:
    """Stands in for an ipyparallel AsyncResult: ``.data``, ``ready()``, ``wait_for_output()``."""

    def __init__(self, record: dict | None = None, ready: bool = False) -> None:
        self.data = {} if record is None else {progress.KEY: record}
        self._ready, self.flushes = ready, 0

    def ready(self) -> bool:
        return self._ready

    def wait_for_output(self, timeout: float) -> bool:
        self.flushes += 1
        return True


def record(step: int, total: int, **metrics: float) -> dict:
    return {"step": step, "total": total, "metrics": metrics}


def test_report_outside_a_rank_does_nothing():
    # torchrun, mp.spawn and plain Python: the same training code runs, silently.
    assert progress.report(1, 10, loss=0.5) is False
    assert progress.report(10, 10) is False


def test_record_text_and_headline_are_plain_stable_text():
    assert bars.record_text(record(12, 46, epoch=2.0, loss=0.53124)) == "12/46  epoch=2 loss=0.5312"
    assert bars.record_text(record(0, 5)) == "0/5"
    assert bars.headline([0, 1]) == "Live progress, one bar per rank (rank 0, rank 1)"


def test_board_shows_nothing_until_a_rank_reports(capsys):
    board = bars.ProgressBars()
    board.update({0: Result(), 1: Result()})
    assert capsys.readouterr().out == ""


def test_board_prints_each_quarter_outside_jupyter(capsys):
    board = bars.ProgressBars()
    board.update({0: Result(record(1, 8, loss=2.0)), 1: Result()})
    board.update({0: Result(record(2, 8, loss=1.5)), 1: Result(record(1, 8))})
    board.update({0: Result(record(8, 8, loss=0.25), ready=True), 1: Result(record(8, 8))})
    assert capsys.readouterr().out.splitlines() == [
        "Live progress, one bar per rank (rank 0, rank 1)",
        "  rank 0: 1/8  loss=2",
        "  rank 0: 2/8  loss=1.5",
        "  rank 1: 1/8",
        "  rank 0: 8/8  loss=0.25",
        "  rank 1: 8/8",
    ]


def test_board_waits_once_for_the_last_update_of_a_finished_rank(capsys):
    board = bars.ProgressBars()
    done = Result(record(3, 8), ready=True)
    board.update({0: done})
    assert done.flushes == 0          # nothing shown yet: no reason to wait
    board.update({0: done})
    board.update({0: done})
    assert done.flushes == 1


def test_a_broken_record_never_breaks_the_run(capsys, caplog):
    board = bars.ProgressBars()
    with caplog.at_level(logging.DEBUG, logger="ddplab.lab.bars"):
        board.update({0: Result({"step": 1})})      # no "total": cannot be drawn
    board.update({0: Result(record(1, 2))})          # ignored from now on, no exception
    assert "rank 0: 1/2" not in capsys.readouterr().out
    # Swallowed for the run's sake, but on the record for whoever debugs it.
    (logged,) = [r for r in caplog.records if r.name == "ddplab.lab.bars"]
    assert logged.levelno == logging.DEBUG and logged.exc_info[0] is KeyError


def test_widget_view_has_a_fixed_text_form_and_moves_its_bars(monkeypatch):
    pytest.importorskip("ipywidgets")
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    view = bars._WidgetView([0, 1])
    assert shown[0]["text/plain"] == "Live progress, one bar per rank (rank 0, rank 1)"
    assert "model_id" in shown[0]["application/vnd.jupyter.widget-view+json"]
    view.update({0: record(5, 10, loss=0.5), 1: record(10, 10)})
    assert (view.bars[0].value, view.bars[0].max, view.bars[0].bar_style) == (5, 10, "info")
    assert (view.bars[1].value, view.bars[1].bar_style) == (10, "success")
    assert view.texts[0].value == "5/10  loss=0.5"


def _train_steps(steps: int) -> int:
    from ddplab import progress
    sent = 0
    for step in range(1, steps + 1):
        sent += progress.report(step, steps, loss=1.0 / step)
    return sent


def test_ranks_publish_and_the_kernel_receives(fresh_lab):
    # One engine's own AsyncResult each, sent without the lab waiting on it.
    results = {rank: fresh_lab.calls.call(rank, _train_steps, 50).result for rank in fresh_lab.ranks}
    for rank, result in results.items():
        assert 1 <= result.get(60) <= 50, "throttled, but the first and last steps always go out"
        assert result.wait_for_output(60)
        assert result.data[progress.KEY] == record(50, 50, loss=1.0 / 50), f"rank {rank}"


def test_the_lab_feeds_the_board_while_it_waits(fresh_lab, monkeypatch):
    seen, boards = [], []

    class Recorder(bars.ProgressBars):
        def __init__(self):
            super().__init__()
            boards.append(self)

        def update(self, results):
            seen.append(sorted(results))
            super().update(results)

    monkeypatch.setattr(bars, "ProgressBars", Recorder)
    assert all(sent >= 1 for sent in fresh_lab.run(_train_steps, 5))
    assert seen and all(ranks == [0, 1] for ranks in seen)
    assert not any(board._broken for board in boards)   # a board that cannot read a result freezes


def test_each_ranks_result_waits_for_its_last_progress_message(fresh_lab):
    """What the board asks of a finished rank's result, in a call to several ranks at once."""
    tasks = fresh_lab.calls.submit(fresh_lab.ranks, _train_steps, 20)
    assert len(tasks) == 2
    for task in tasks:
        assert task.result.get(60) >= 1
        assert task.result.wait_for_output(30)
        assert channel.published(task.result)[progress.KEY]["step"] == 20     # the last step's


@pytest.fixture(scope="module")
def attached_lab(tmp_path_factory):
    """A lab attached to engines it did not start, as on several hosts: like engines that
    ipcluster, ssh or Slurm started, they have no DDPLAB_PARENT_PID."""
    import subprocess
    import sys

    import ipyparallel as ipp

    from ddplab import procs
    from ddplab.lab import Lab, LabSpec
    from ddplab.lab.multihost.host_ranks import HostRanks

    work = tmp_path_factory.mktemp("attached")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPLAB_")}
    common = [f"--profile-dir={work}", "--cluster-id=attached"]
    started = [procs.start([sys.executable, "-m", "ipyparallel.controller", "--ip=127.0.0.1",
                            *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=env)]
    started += [procs.start([sys.executable, "-m", "ipyparallel.engine",
                             "--IPEngine.wait_for_url_file=120", *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
                for _ in range(2)]
    url_file = f"{work}/security/ipcontroller-attached-client.json"
    spec = LabSpec(world_size=2, backend="gloo", timeout=120, grace=2.0, pg_timeout=120,
                   debug=False)
    lab = Lab(spec, engines=HostRanks(spec, connect=lambda: ipp.Client(url_file, timeout=120)))
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(url_file):
            assert time.monotonic() < deadline, "the controller wrote no connection file in 120 s"
            time.sleep(0.1)
        yield lab.start()
    finally:
        lab.stop()
        assert procs.end_tree(*started, grace=5) == []
        for p in started:
            p.wait()


@pytest.mark.slow
def test_ranks_of_an_attached_lab_publish_progress(attached_lab):
    # Multi-host engines never get DDPLAB_PARENT_PID; progress must still see it is on a rank.
    assert all(sent >= 1 for sent in attached_lab.run(_train_steps, 5))
