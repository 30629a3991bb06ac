"""A real Jupyter kernel's cells run as a front end runs them: what tests/test_debugger_*.py share.

Each cell is sent with ``allow_stdin=True`` and each ``input_request`` (the input box
JupyterLab would show) is answered on the stdin channel, while the iopub messages are
read: the text the kernel prints, its error, and the live status of the ranks. The
kernel itself is conftest.py's ``lab_kernel``; its ``k`` fixture makes its lab usable.
"""

from __future__ import annotations

import queue
import re
import time
from dataclasses import dataclass, field


@dataclass
class Run:
    """What a front end saw of one cell."""
    prompts: list[str] = field(default_factory=list)    # each input_request's prompt
    stdout: str = ""
    error: str = ""                                      # the error's name and value, if any
    statuses: list[str] = field(default_factory=list)   # live areas' texts, in order


def run(client, code: str, answers=(), limit: float = 60, before_answer=None,
        allow_stdin: bool = True) -> Run:
    """Run ``code``; answer the prompts with ``answers`` in order; return what came back.

    ``before_answer(run)``: called at each prompt, before it is answered; it may
    read more iopub messages through ``run`` (see ``wait_for_status``).
    """
    answers = list(answers)
    msg_id = client.execute(code, allow_stdin=allow_stdin)
    seen = Run()
    deadline = time.monotonic() + limit

    def take(msg) -> bool:
        """Note one iopub message; True at the cell's end."""
        if msg["parent_header"].get("msg_id") != msg_id:
            return False
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            seen.stdout += content["text"]
        elif kind in ("display_data", "update_display_data"):
            text = content["data"].get("text/plain", "")
            if text:
                seen.statuses.append(text)
        elif kind == "error":
            seen.error = f"{content['ename']}: {content['evalue']}"
        return kind == "status" and content["execution_state"] == "idle"

    seen.take = take                                    # for before_answer
    while time.monotonic() < deadline:
        try:
            request = client.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            request = None
        if request is not None:
            seen.prompts.append(request["content"]["prompt"])
            if before_answer is not None:
                before_answer(seen, client)
            assert answers, f"an unexpected prompt {seen.prompts[-1]!r}; output so far:\n{seen.stdout}"
            client.input(answers.pop(0))
        try:
            while True:
                if take(client.get_iopub_msg(timeout=0.05)):
                    assert not answers, (f"prompts left unanswered: {answers}; got {seen.error}:\n"
                                        f"{seen.stdout}")
                    return seen
        except queue.Empty:
            pass
    raise AssertionError(f"the cell did not end in {limit} s; prompts {seen.prompts}, "
                         f"output:\n{seen.stdout}")


def wait_for_status(*patterns: str, limit: float = 15):
    """A ``before_answer`` that reads iopub until live areas match each of ``patterns``."""
    pattern = "; ".join(patterns)

    def wait(seen: Run, client) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if all(any(re.search(p, s) for s in seen.statuses) for p in patterns):
                return
            try:
                seen.take(client.get_iopub_msg(timeout=0.1))
            except queue.Empty:
                pass
        raise AssertionError(f"no live status matched {pattern!r} while the prompt waited: "
                             f"{seen.statuses}")
    return wait


def ok(client, code: str) -> str:
    seen = run(client, code)
    assert not seen.error, seen.error
    return seen.stdout
