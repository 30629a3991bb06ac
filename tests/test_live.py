"""ddplab.lab.live: the kernel's live areas never fail a cell, and say why they gave up.

No kernel, no engines: results and the front end are stand-ins.
"""

from __future__ import annotations

import logging

from ddplab.lab import live


class _Garbled:
    """An AsyncResult whose published data cannot be read."""

    _metadata = [{"data": ["not", "a", "dict"]}]


def test_a_result_whose_data_cannot_be_read_shows_no_screen_and_no_status(caplog):
    with caplog.at_level(logging.DEBUG, logger="ddplab.lab.live"):
        assert live.screen(_Garbled()) is None
        assert live.reported(_Garbled()) == ""
    assert [r.exc_info[0] for r in caplog.records] == [AttributeError, AttributeError]


class _Task:
    """A cluster task as the board reads it: a rank, its AsyncResult, no outcome yet."""

    def __init__(self, rank: int, screen: str) -> None:
        self.rank, self.outcome = rank, None
        self.result = type("Result", (), {"_metadata": [{"data": {live.KEY: screen}}]})()


def test_closing_areas_the_front_end_refuses_logs_and_empties_the_board(monkeypatch, caplog):
    import IPython.display
    sent, gone = [], []

    def publish(data, transient, update):
        if gone:
            raise RuntimeError("front end gone")
        sent.append((transient["display_id"], data))

    monkeypatch.setattr(IPython.display, "publish_display_data", publish)
    monkeypatch.setattr(live, "OPEN_AFTER", 0.0)
    board = live.Board()
    board.enabled = True                       # as in a Jupyter kernel
    board.update([_Task(1, "step 2\n"), _Task(0, "step 1\n")])
    assert [data for _, data in sent][-2:] == [{"text/plain": "[rank 0] (running)\nstep 1"},
                                               {"text/plain": "[rank 1] (running)\nstep 2"}]
    areas = [display_id for display_id, data in sent if not data]
    gone.append(True)
    with caplog.at_level(logging.DEBUG, logger="ddplab.lab.live"):
        board.close()                          # no exception: the final output follows anyway
    assert [r.getMessage() for r in caplog.records] == [
        f"could not empty live area {area}" for area in areas]
    assert len(areas) == 2
