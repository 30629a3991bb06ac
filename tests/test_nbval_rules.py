"""ddplab reads notebooks as nbval does without importing nbval (``ddplab.grade.nbval_rules``):
a student's install has none, yet copies notebooks by nbval's rules. Here its rules are held
against the installed nbval's, on the cases the course has and the odd ones."""

from __future__ import annotations

import copy

import nbformat
import pytest
from nbval import plugin

from ddplab.grade import nbval_rules

SOURCES = ["x = 1", "# NBVAL_IGNORE_OUTPUT\nprint(1)", "  #   NBVAL_SKIP  \n", "# NBVAL_RAISES_EXCEPTION",
           "# NBVAL_CHECK_OUTPUT\n# NBVAL_IGNORE_OUTPUT", "#PYTEST_VALIDATE_IGNORE_OUTPUT",
           "print('# NBVAL_SKIP')", "## NBVAL_SKIP", "# nbval_skip", ""]
TAGS = [{}, {"tags": []}, {"tags": ["raises-exception"]}, {"tags": ["nbval-ignore-output", "x"]},
        {"tags": ["nbval-skip", "nbval-check-output"]}, {"tags": ["pytest-validate-ignore-output"]}]
STREAMS = [
    [],
    [{"output_type": "stream", "name": "stdout", "text": "a\n"},
     {"output_type": "stream", "name": "stderr", "text": "w\n"},
     {"output_type": "stream", "name": "stdout", "text": "b\n"}],
    [{"output_type": "stream", "name": "stdout", "text": " 10%\r 50%\r100%\ndone\n"}],
    [{"output_type": "stream", "name": "stdout", "text": "ab\bc\n\rx\r\n"}],
    [{"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {},
      "execution_count": 1},
     {"output_type": "stream", "name": "stdout", "text": "after\r"}],
]


def test_the_tables_are_nbvals():
    assert nbval_rules.comment_markers == plugin.comment_markers
    assert nbval_rules.metadata_tags == plugin.metadata_tags


@pytest.mark.parametrize("source", SOURCES)
def test_comment_markers_are_read_as_nbval_reads_them(source):
    assert dict(nbval_rules.find_comment_markers(source)) == dict(plugin.find_comment_markers(source))


@pytest.mark.parametrize("metadata", TAGS)
def test_tags_are_read_as_nbval_reads_them(metadata):
    assert dict(nbval_rules.find_metadata_tags(metadata)) == dict(plugin.find_metadata_tags(metadata))


@pytest.mark.parametrize("outputs", STREAMS)
def test_streams_merge_as_nbval_merges_them(outputs):
    ours = nbval_rules.coalesce_streams([nbformat.from_dict(copy.deepcopy(o)) for o in outputs])
    theirs = plugin.coalesce_streams([nbformat.from_dict(copy.deepcopy(o)) for o in outputs])
    assert ours == theirs


def test_the_sanitize_file_gives_nbvals_pairs():
    from importlib import resources
    text = resources.files("ddplab.grade").joinpath("nbval_sanitize.cfg").read_text()
    assert nbval_rules.sanitize_pairs(text) == plugin.get_sanitize_patterns(text)
    lost_space = "regex: a\nreplace:\nregex: b\nreplace: c\n"
    assert nbval_rules.sanitize_pairs(lost_space) == plugin.get_sanitize_patterns(lost_space)
