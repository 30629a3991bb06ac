"""%%ranks and %%rank in a real IPython shell, on real engines."""


from conftest import cell_error

import ddplab


def test_ranks_cell_runs_everywhere_with_persistent_namespace(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%ranks\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)") is None
    assert cell_error(shell, "%%ranks\nprint(rank, world_size, x.item())\nx.item() * 10") is None
    assert capsys.readouterr().out == "[rank 0]\n0 2 3.0\n30.0\n[rank 1]\n1 2 3.0\n30.0\n"


def test_rank_cell_runs_on_named_ranks_only(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%rank 1\nprint('only', rank)") is None
    assert capsys.readouterr().out == "[rank 1]\nonly 1\n"


def test_random_timing_output_is_identical_every_run(shell, fresh_lab, capsys):
    cell = "%%ranks\nimport random, time\ntime.sleep(random.random() / 10)\nprint('rank', rank, 'done')"
    outputs = set()
    for _ in range(5):
        assert cell_error(shell, cell) is None
        outputs.add(capsys.readouterr().out)
    assert outputs == {"[rank 0]\nrank 0 done\n[rank 1]\nrank 1 done\n"}


def test_error_on_one_rank_fails_the_cell(shell, fresh_lab, capsys):
    error = cell_error(shell, "%%ranks\nprint('before')\nif rank == 1:\n    raise KeyError('oops')")
    assert isinstance(error, ddplab.RankError)
    assert set(error.failures) == {1}
    assert "line 3" in error.failures[1] and "KeyError: 'oops'" in error.failures[1]
    out = capsys.readouterr().out
    assert out.startswith("[rank 0]\nbefore\n[rank 1]\nbefore\n")
    # IPython shows ddplab's message, not ddplab's own kernel-side frames.
    assert "RankError: ddplab: the code raised on rank 1." in out and "cluster.py" not in out


def test_rank_out_of_range_is_a_clear_error(shell, fresh_lab):
    error = cell_error(shell, "%%rank 5\nprint(1)")
    assert isinstance(error, ddplab.ConfigError)
    assert "has ranks 0..1 (world_size=2)" in str(error) and "world_size=6" in str(error)


def test_two_prompts_send_waits_for_recv(shell, fresh_lab, capsys):
    # Prompt 1: rank 0 sends; gloo's send waits until rank 1 posts its recv.
    assert cell_error(shell, "%%rank 0\ndist.send(torch.arange(3.0), dst=1)\nprint('sent')") is None
    first = capsys.readouterr().out
    assert first.startswith("ddplab: rank 0 is still running this cell")
    assert "sent" not in first
    # Prompt 2: rank 1 receives; now both finish, shown in the order they were run.
    assert cell_error(shell, "%%rank 1\nt = torch.zeros(3)\ndist.recv(t, src=0)\nprint('got', t)") is None
    assert capsys.readouterr().out == (
        "[rank 0] (the earlier cell that was still running)\nsent\n"
        "[rank 1]\ngot tensor([0., 1., 2.])\n")


def test_lab_wait_shows_late_output(shell, fresh_lab, capsys):
    assert cell_error(shell, "%%rank 1 --grace 0.2\nimport time\ntime.sleep(1)\nprint('slow')") is None
    assert "rank 1 is still running" in capsys.readouterr().out
    fresh_lab.wait()
    assert capsys.readouterr().out == "[rank 1] (the earlier cell that was still running)\nslow\n"


def test_bad_magic_options_name_the_fix(shell, fresh_lab):
    assert "needs a number of seconds" in str(cell_error(shell, "%%ranks --timeout soon\n1"))
    assert "takes no rank numbers" in str(cell_error(shell, "%%ranks 0\n1"))
    assert "needs the ranks" in str(cell_error(shell, "%%rank\n1"))


def test_pdb_with_no_one_to_answer_continues_and_says_so(shell, fresh_lab, capsys):
    # pytest's captured stdin refuses input(), as nbval's kernel refuses an input_request:
    # the rank must not wait for an answer that never comes. (Prompts answered through a
    # real kernel: tests/test_debugger_pdb.py.)
    assert cell_error(shell, "%%rank 1 --pdb\na = 41\nprint(a + 1)") is None
    out = capsys.readouterr().out
    assert "rank 1 stopped in the debugger, but this front end cannot answer a prompt" in out
    assert out.endswith("[rank 1]\n42\n"), out
    assert "takes at most one rank number" in str(cell_error(shell, "%ddplab_debug one"))
    assert "names rank 7" in str(cell_error(shell, "%ddplab_debug 7"))


def test_notebook_function_may_use_kernel_globals(shell, fresh_lab):
    # A student imports dist in the kernel and uses it in a lambda: it must work on the ranks.
    assert cell_error(shell, "import torch.distributed as dist\nscale = 3\n"
                      "got = ddplab.current().run(lambda: dist.get_rank() * scale)") is None
    assert shell.user_ns["got"] == [0, 3]
