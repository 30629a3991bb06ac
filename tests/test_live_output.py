"""Live output through a real Jupyter kernel: what reaches the front end, and when.

A kernel started with jupyter_client, a lab in it (tests/conftest.py's lab_kernel), and the
iopub messages a front end would get are read with their arrival times.
"""

import time

import pytest

pytestmark = pytest.mark.slow       # a kernel with a lab in it (conftest's lab_kernel, per module)

CELL = ("%%ranks\nimport time\nfor i in range(6):\n"
        "    print(f'rank {rank} line {i}', flush=True)\n    time.sleep(0.5)\n")
FINAL = "".join(f"[rank {r}]\n" + "".join(f"rank {r} line {i}\n" for i in range(6))
                for r in range(2))


def execute(client, code, limit=120):
    """Run ``code``; return [(seconds since sent, message)] up to the idle status."""
    begin = time.monotonic()
    msg_id = client.execute(code)
    got = []
    while True:
        msg = client.get_iopub_msg(timeout=limit)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        got.append((time.monotonic() - begin, msg))
        if msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return got


@pytest.fixture
def kernel(lab_kernel):
    """The session's kernel (tests/conftest.py), its lab usable (tests/test_debugger_*.py's tests
    may have left it to restart)."""
    execute(lab_kernel, "if not lab.healthy: lab.restart()")
    return lab_kernel


def stored(messages):
    """The outputs a notebook stores (as nbconvert and nbval build them)."""
    outputs = []
    for _, msg in messages:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if outputs and outputs[-1][0] == ("stream", content["name"]):
                outputs[-1] = (outputs[-1][0], outputs[-1][1] + content["text"])
            else:
                outputs.append((("stream", content["name"]), content["text"]))
        elif kind in ("display_data", "execute_result"):
            outputs.append(((kind,), content["data"]))
    return outputs


def test_a_line_reaches_the_front_end_long_before_the_cell_ends(kernel):
    messages = execute(kernel, CELL)
    end = messages[-1][0]
    assert end >= 3.0
    live = [(t, m["content"]["data"].get("text/plain", "")) for t, m in messages
            if m["msg_type"] in ("display_data", "update_display_data")]
    first = next((t for t, text in live if text.startswith("[rank 0] (running)")
                  and "rank 0 line 0" in text), None)
    assert first is not None, live
    assert first < end - 1.5, f"rank 0's first line arrived at {first:.2f} s, the cell ended at {end:.2f} s"
    # One area per rank, in rank order, updated in place, never interleaved.
    opened = [m["content"]["transient"]["display_id"] for _, m in messages
              if m["msg_type"] == "display_data"]
    assert len(opened) == 2
    for display_id, rank in zip(opened, (0, 1)):
        texts = [m["content"]["data"].get("text/plain", "") for _, m in messages
                 if m["msg_type"] == "update_display_data"
                 and m["content"]["transient"]["display_id"] == display_id]
        assert all(t.startswith(f"[rank {rank}]") for t in texts if t)
        assert texts[-1] == ""            # emptied when the cell ends
    # What is stored is what was stored before live output: empty areas, then the text.
    assert stored(messages) == [(("display_data",), {}), (("display_data",), {}),
                                (("stream", "stdout"), FINAL)]


def test_a_quick_cell_opens_no_live_area(kernel):
    messages = execute(kernel, "%%ranks\nprint(rank)")
    assert stored(messages) == [(("stream", "stdout"), "[rank 0]\n0\n[rank 1]\n1\n")]


# Rank 0 waits in recv until rank 1 sends, 3 s in (rank 1's sleep is the scenario,
# not the test hoping): rank 0's label must say where it waits while it waits.
BLOCKED_CELL = ("%%ranks\nimport time\nt = torch.zeros(1)\nif rank == 0:\n"
                "    dist.recv(t, src=1)\n    print('got', t.item(), flush=True)\n    time.sleep(1.5)\n"
                "else:\n    time.sleep(3)\n    dist.send(torch.ones(1), dst=0)\n")


def test_a_rank_blocked_in_recv_says_so_while_it_waits(kernel):
    messages = execute(kernel, BLOCKED_CELL)
    end = messages[-1][0]
    rank0 = [(t, m["content"]["data"].get("text/plain", "")) for t, m in messages
             if m["msg_type"] in ("display_data", "update_display_data")
             and m["content"]["data"].get("text/plain", "").startswith("[rank 0]")]
    blocked = [t for t, text in rank0 if text.startswith("[rank 0] (blocked in recv, cell line 4)")]
    assert blocked, rank0
    assert blocked[0] < end - 1.5, f"first 'blocked' at {blocked[0]:.2f} s, cell ended at {end:.2f} s"
    # Once recv returns, the label goes back to running (and shows what rank 0 printed).
    assert any(t > blocked[-1] and text == "[rank 0] (running)\ngot 1.0" for t, text in rank0), rank0
    # The status is live only: the stored output is the text, as without live areas.
    assert stored(messages) == [(("display_data",), {}), (("display_data",), {}),
                                (("stream", "stdout"), "[rank 0]\ngot 1.0\n")]


# --- Replayed as a front end renders it (issue 44: VS Code, several handles from one cell) ---
#
# VS Code's Jupyter extension keeps, per notebook, display_id -> the LAST output shown with it, and
# an update replaces that output's items in place (src/kernels/execution/cellDisplayIdTracker.ts);
# the protocol says every output with that id. Twice it shipped a bug in exactly this pattern:
# v2023.1 replaced all of a cell's outputs on an update (microsoft/vscode-jupyter#12755, fixed
# by #12768), v2023.2 lost every update after a display's first (#13105, fixed by #13109).
# So the messages are held to what both models render alike: each display_id opened once, by a
# display_data of its own cell, before any update; ids never reused; no clear_output.

MECHANISMS = {"status", "execute_input", "stream", "display_data", "update_display_data"}


class FrontEnd:
    """A notebook's outputs as the messaging protocol defines them, message by message.

    ``last_only``: VS Code's model instead, where an update reaches only the last output
    shown with its display_id.
    """

    def __init__(self, last_only: bool = False) -> None:
        self.cells: list[list[dict]] = []
        self.last_only = last_only
        self.last: dict[str, dict] = {}

    def run(self, messages) -> list[list[list[dict]]]:
        """Start a cell and render its messages; what the cell shows after each one."""
        self.cells.append([])
        cell, seen = self.cells[-1], []
        for _, msg in messages:
            kind, content = msg["msg_type"], msg["content"]
            display_id = content.get("transient", {}).get("display_id")
            if kind == "stream":
                if cell and cell[-1].get("name") == content["name"]:
                    cell[-1]["text"] += content["text"]
                else:
                    cell.append({"name": content["name"], "text": content["text"]})
            elif kind == "display_data":
                cell.append({"data": content["data"], "display_id": display_id})
                if display_id:
                    self.last[display_id] = cell[-1]
            elif kind == "update_display_data":
                shown = ([self.last[display_id]] if display_id in self.last else []) if self.last_only \
                    else [o for c in self.cells for o in c if o.get("display_id") == display_id]
                for output in shown:
                    output["data"] = content["data"]
            seen.append([dict(o) for o in cell])
        return seen


def areas(outputs: list[dict]) -> list[str]:
    """The text each live area shows, in the order of the cell's outputs."""
    return [o["data"].get("text/plain", "") for o in outputs if o.get("display_id")]


# Each cell run for the replay, with the lines each rank's area may show (in order, as a prefix).
REPLAYED = [(CELL, {r: [f"rank {r} line {i}" for i in range(6)] for r in (0, 1)}),
            (BLOCKED_CELL, {0: ["got 1.0"], 1: []})]


def test_live_areas_replayed_as_vs_code_renders_them_end_in_rank_order(kernel):
    runs = [execute(kernel, code) for code, _ in REPLAYED]
    spec, vscode = FrontEnd(), FrontEnd(last_only=True)
    opened: list[str] = []
    for (_, lines), messages in zip(REPLAYED, runs):
        # Only what VS Code renders: no clear_output, every message a child of the cell's request.
        assert {m["msg_type"] for _, m in messages} <= MECHANISMS, "a mechanism VS Code may not render"
        assert {m["parent_header"]["msg_id"] for _, m in messages} == {
            messages[0][1]["parent_header"]["msg_id"]}
        ids = [m["content"]["transient"]["display_id"] for _, m in messages
               if m["msg_type"] == "display_data"]
        assert len(ids) == 2 == len(set(ids)) and not set(ids) & set(opened), (ids, opened)
        opened += ids
        for i, (_, m) in enumerate(messages):       # an update comes after its display, never before
            if m["msg_type"] == "update_display_data":
                assert m["content"]["transient"]["display_id"] in {
                    n["content"]["transient"]["display_id"] for _, n in messages[:i]
                    if n["msg_type"] == "display_data"}
        steps = spec.run(messages)
        assert steps == vscode.run(messages), "VS Code's model shows another thing than the protocol's"
        # At every step: one area per rank, rank 0's first, each empty or under its own label
        # with its own rank's lines in order.
        last = {}
        for outputs in steps:
            for rank, text in enumerate(areas(outputs)):
                if text:
                    label, *shown = text.split("\n")
                    assert label.startswith(f"[rank {rank}] ("), areas(outputs)
                    assert shown == lines[rank][:len(shown)], (rank, areas(outputs))
                    last[rank] = shown
        assert sorted(last) == [0, 1], f"an area never showed its rank: {[areas(o) for o in steps]}"
        assert all(last[rank] for rank in lines if lines[rank]), f"no line of a rank made it live: {last}"
    # Each area's final text: empty, with the rank-ordered text after the areas, in both cells.
    final = [(areas(cell), [o["text"] for o in cell if "name" in o]) for cell in spec.cells]
    assert final == [(["", ""], [FINAL]), (["", ""], ["[rank 0]\ngot 1.0\n"])], final
    assert [list(o) for o in spec.cells[0]] == [["data", "display_id"]] * 2 + [["name", "text"]]
