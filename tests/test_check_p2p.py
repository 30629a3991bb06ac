"""Checkers of notebook 01 (point-to-point): each passes a right answer and fails wrong ones.

The answers are functions as a student would write them in the notebook. They
are shipped to the ranks by value (cloudpickle), as notebook functions are.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_gather as gather_all  # an alias bound before any check runs

from ddplab.check import nb01_point_to_point as p2p

pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _fails(check, *args, match: str, **kwargs) -> str:
    """Run a checker on a wrong answer: it must raise AssertionError matching ``match``."""
    with pytest.raises(AssertionError, match=match) as info:
        check(*args, **kwargs)
    return str(info.value)


def test_sample_differs_per_rank_and_case():
    assert not torch.equal(p2p.sample(0, 0), p2p.sample(0, 1))
    assert p2p.sample(3, 0).dtype == torch.int64
    assert torch.equal(p2p.sample(2, 1), p2p.sample(2, 1))
    assert not torch.equal(p2p.sample(2, 1, seed=1), p2p.sample(2, 1, seed=2))   # drawn per trial


# ------------------------------------------------------------------ ping_pong
def ping_pong_right(x):
    if dist.get_rank() == 0:
        dist.send(x, dst=1)
        reply = torch.empty_like(x)
        dist.recv(reply, src=1)
        return reply
    received = torch.empty_like(x)
    dist.recv(received, src=0)
    dist.send(2 * received, dst=0)
    return received


def ping_pong_not_doubled(x):
    if dist.get_rank() == 0:
        dist.send(x, dst=1)
        dist.recv(x, src=1)
        return x
    received = torch.empty_like(x)
    dist.recv(received, src=0)
    dist.send(received, dst=0)
    return received


def ping_pong_returns_reply_on_both(x):
    if dist.get_rank() == 0:
        dist.send(x, dst=1)
        reply = torch.empty_like(x)
        dist.recv(reply, src=1)
        return reply
    received = torch.empty_like(x)
    dist.recv(received, src=0)
    received *= 2
    dist.send(received, dst=0)
    return received


@pytest.mark.exercise("ping_pong", "mistake", "the reply not doubled")
@pytest.mark.exercise("ping_pong", "mistake", "rank 1 returns the doubled reply")
def test_ping_pong(fresh_lab, capsys):
    p2p.ping_pong(ping_pong_right)
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct: rank 0 got back twice")
    message = _fails(p2p.ping_pong, ping_pong_not_doubled, match="is wrong on rank 0")
    assert "rank 0: expected" in message and "<-- wrong" in message and "Hint:" in message
    message = _fails(p2p.ping_pong, ping_pong_returns_reply_on_both, match="is wrong on rank 1")
    assert "rank 0: expected" in message    # every rank's row, right ones too


def test_ping_pong_names_its_argument(fresh_lab):
    _fails(p2p.ping_pong, None, match=r"(?s)needs the function you wrote.*ping_pong\(ping_pong\)")


# --------------------------------------------------------------- swap_tensors
def swap_right(t):
    other = 1 - dist.get_rank()
    received = torch.empty_like(t)
    requests = [dist.isend(t, dst=other), dist.irecv(received, src=other)]
    for request in requests:
        request.wait()
    return received


def swap_nothing(t):
    return t


def swap_into_t(t):
    other = 1 - dist.get_rank()
    requests = [dist.isend(t.clone(), dst=other), dist.irecv(t, src=other)]
    for request in requests:
        request.wait()
    return t


def swap_deadlocks(t):
    other = 1 - dist.get_rank()
    dist.send(t, dst=other)
    received = torch.empty_like(t)
    dist.recv(received, src=other)
    return received


@pytest.mark.exercise("swap_tensors", "mistake", "returns its own tensor")
@pytest.mark.exercise("swap_tensors", "mistake", "receives into t")
def test_swap_tensors(fresh_lab, capsys):
    p2p.swap_tensors(swap_right)
    assert capsys.readouterr().out.startswith("Correct: each rank returned the other rank's tensor")
    _fails(p2p.swap_tensors, swap_nothing, match=r"swap\(t\) with an input .* is wrong on ranks 0, 1")
    message = _fails(p2p.swap_tensors, swap_into_t, match=r"t after swap\(t\) .* is wrong on ranks 0, 1")
    assert "Hint: receive into a new buffer" in message


@pytest.mark.exercise("swap_tensors", "mistake", "two blocking sends facing each other")
def test_swap_tensors_reports_a_deadlock_per_rank(fresh_lab):
    message = _fails(p2p.swap_tensors, swap_deadlocks, timeout=5, match="a deadlock")
    assert "rank 0: still in send" in message and "rank 1: still in send" in message
    assert "Hint: every rank is waiting in send" in message       # the lab's verdict, where they are
    assert "lab.restart()" in message


def test_p2p_deadlocks_are_reported_within_15_s_by_default():
    import inspect

    assert inspect.signature(p2p.swap_tensors).parameters["timeout"].default <= 15


def swap_into_a_float_buffer(t):
    other = 1 - dist.get_rank()
    received = torch.zeros(t.shape)              # float32, whatever t's dtype
    requests = [dist.isend(t, dst=other), dist.irecv(received, src=other)]
    for request in requests:
        request.wait()
    return received


@pytest.mark.exercise("swap_tensors", "mistake", "a float32 buffer for an int64 tensor")
def test_a_float_buffer_for_an_int_tensor_is_named_as_a_dtype_mismatch(fresh_lab):
    message = _fails(p2p.swap_tensors, swap_into_a_float_buffer,
                     match=r"a dtype or size mismatch: dist\.irecv receives into a tensor of "
                           r"float32, 6 element\(s\), but in this trial every rank's input is "
                           r"float64, 6 element\(s\)")
    assert "torch.empty_like(t)" in message and "lab.restart()" in message
    assert "collective" not in message        # not gloo's abort, which blames "a collective"
    assert not fresh_lab.broken_reason        # refused before gloo saw it: no rank crashed
    fresh_lab.restart()                       # the isend already posted was never received
    p2p.swap_tensors(swap_right)


def test_swap_tensors_needs_two_ranks(fresh_lab4):
    _fails(p2p.swap_tensors, swap_right, match=r"2 ranks.*world_size=4")


# --------------------------------------------------------- neighbour_exchange
def exchange_right(t):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    from_left, from_right = torch.empty_like(t), torch.empty_like(t)
    ops = [dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right),
           dist.P2POp(dist.isend, t, left), dist.P2POp(dist.isend, t, right)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return from_left, from_right


def exchange_sides_swapped(t):
    from_left, from_right = exchange_right(t)
    return from_right, from_left


def exchange_own_twice(t):
    return t.clone(), t.clone()


@pytest.mark.exercise("neighbour_exchange", "mistake", "left and right swapped")
@pytest.mark.exercise("neighbour_exchange", "mistake", "its own tensor twice")
def test_neighbour_exchange(fresh_lab4, capsys):
    p2p.neighbour_exchange(exchange_right)
    assert capsys.readouterr().out.startswith("Correct: every rank got its left and right")
    message = _fails(p2p.neighbour_exchange, exchange_sides_swapped,
                     match=r"from_left, from_right\) .* is wrong on ranks 0, 1, 2, 3")
    assert message.count("expected") == 4
    _fails(p2p.neighbour_exchange, exchange_own_twice, match="is wrong on ranks 0, 1, 2, 3")


# -------------------------------------------------------------- all_gather_p2p
def all_gather_right(tensor_list, tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    requests = []
    for peer in range(world_size):
        if peer == rank:
            tensor_list[peer].copy_(tensor)
        else:
            requests.append(dist.isend(tensor, dst=peer))
            requests.append(dist.irecv(tensor_list[peer], src=peer))
    for request in requests:
        request.wait()


def all_gather_own_only(tensor_list, tensor):
    tensor_list[dist.get_rank()].copy_(tensor)


def all_gather_shifted(tensor_list, tensor):
    everyone = [torch.empty_like(tensor) for _ in tensor_list]
    all_gather_right(everyone, tensor)
    for i, item in enumerate(everyone):
        tensor_list[(i + 1) % len(tensor_list)].copy_(item)


def all_gather_rebinds(tensor_list, tensor):
    everyone = [torch.empty_like(tensor) for _ in tensor_list]
    all_gather_right(everyone, tensor)
    tensor_list = everyone          # noqa: F841  (the caller's list is untouched)


def all_gather_with_the_collective(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)


def all_gather_into_one_tensor(tensor_list, tensor):
    out = torch.empty((len(tensor_list), *tensor.shape), dtype=tensor.dtype)
    dist.all_gather_into_tensor(out, tensor)
    for item, row in zip(tensor_list, out):
        item.copy_(row)


def all_gather_through_an_alias(tensor_list, tensor):
    gather_all(tensor_list, tensor)


def all_gather_through_the_group(tensor_list, tensor):
    dist.group.WORLD.allgather([tensor_list], [tensor]).wait()


@pytest.mark.exercise("all_gather_p2p", "bypass")
def test_all_gather_p2p_may_not_call_a_collective(fresh_lab4):
    message = _fails(p2p.all_gather_p2p, all_gather_with_the_collective,
                     match=r"^my_all_gather builds all_gather from send/recv, so it may not call "
                           r"dist\.all_gather \(at all_gather_with_the_collective line \d+\), on ranks "
                           r"0, 1, 2, 3\.\nHint: the check refuses the collective itself.* Use "
                           r"dist\.send/dist\.recv")
    assert message.count("may not call") == 1, message         # once, not once per rank
    _fails(p2p.all_gather_p2p, all_gather_into_one_tensor, match=r"may not call dist\.all_gather_into_tensor")
    assert not fresh_lab4.broken_reason       # every rank refused at once: nobody is left waiting
    p2p.all_gather_p2p(all_gather_right)      # and the collective works again afterwards


@pytest.mark.exercise("all_gather_p2p", "bypass")
def test_all_gather_p2p_refuses_the_collective_under_any_name(fresh_lab4):
    """A module-level ``from torch.distributed import all_gather as gather_all``, bound before the
    check, is the real function: the check refuses the collective at the process group."""
    _fails(p2p.all_gather_p2p, all_gather_through_an_alias,
           match=r"my_all_gather builds all_gather from send/recv, so it may not call dist\.all_gather "
                 r"\(at all_gather_through_an_alias line \d+\)")
    _fails(p2p.all_gather_p2p, all_gather_through_the_group,
           match=r"may not call all_gather, through the process group's \.allgather")
    assert not fresh_lab4.broken_reason
    p2p.all_gather_p2p(all_gather_right)


@pytest.mark.exercise("all_gather_p2p", "mistake", "only its own entry")
@pytest.mark.exercise("all_gather_p2p", "mistake", "entries shifted by one")
@pytest.mark.exercise("all_gather_p2p", "mistake", "rebinds the list")
def test_all_gather_p2p(fresh_lab4, capsys):
    p2p.all_gather_p2p(all_gather_right)
    assert capsys.readouterr().out == \
        "Correct: my_all_gather fills tensor_list exactly like dist.all_gather.\n"
    message = _fails(p2p.all_gather_p2p, all_gather_own_only, match="is wrong on ranks 0, 1, 2, 3")
    assert "-1" in message                 # the entries never written show as -1
    _fails(p2p.all_gather_p2p, all_gather_shifted, match="tensor_list after .* is wrong")
    _fails(p2p.all_gather_p2p, all_gather_rebinds, match="tensor_list after .* is wrong")


def test_all_gather_p2p_on_two_ranks(fresh_lab):
    p2p.all_gather_p2p(all_gather_right)


# ------------------------------------------------------------------ ring_token
RING_RIGHT = """
left, right = (rank - 1) % world_size, (rank + 1) % world_size
if rank == 0:
    token = torch.tensor([0.0])
    dist.send(token, dst=right)
    dist.recv(token, src=left)
else:
    token = torch.zeros(1)
    dist.recv(token, src=left)
    token += rank
    dist.send(token, dst=right)
"""
# Every rank keeps its own number: nothing went around.
RING_NO_PASS = "token = torch.tensor([float(rank)])"
# The ring walked the other way round: 0 -> 3 -> 2 -> 1 -> 0.
RING_REVERSED = RING_RIGHT.replace("dst=right", "dst=LEFT").replace("src=left", "src=right") \
    .replace("LEFT", "left")


@pytest.mark.exercise("ring_token", "mistake", "nothing passed on")
@pytest.mark.exercise("ring_token", "mistake", "the ring walked the other way")
def test_ring_token(fresh_lab4, capsys):
    fresh_lab4.run_cell(RING_RIGHT)
    p2p.ring_token()
    assert capsys.readouterr().out == "Correct: the token went once around the ring of 4 ranks.\n"
    fresh_lab4.run_cell(RING_NO_PASS)
    message = _fails(p2p.ring_token, match="token is wrong on ranks 0, 2, 3")
    assert "rank 3: expected the ring's sum up to this rank" in message
    assert "6.0" not in message                    # rank 3's right token: the answer, never shown
    fresh_lab4.run_cell(RING_REVERSED)
    message = _fails(p2p.ring_token, match="token is wrong on ranks 1, 2, 3")
    assert "got      [6.0] (float32)   <-- wrong" in message


@pytest.mark.exercise("ring_token", "stub")
def test_ring_token_without_the_variable(fresh_lab4):
    fresh_lab4.run_cell("token = torch.zeros(1)", ranks=[0, 1, 3])
    fresh_lab4.run_cell("token = 1\ndel token", ranks=[2])
    _fails(p2p.ring_token, match="no variable `token` on rank 2")


# ------------------------------------------------------- answers that want the verdict for free
def gather_from_the_checkers_frames(tensor_list, tensor):
    """Copies the expected list out of a checker's frame on this rank: no communication."""
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("expected")
        if isinstance(found, list) and len(found) == len(tensor_list):
            for out, value in zip(tensor_list, found):
                out.copy_(value)
            return
        frame = frame.f_back
    tensor_list[dist.get_rank()].copy_(tensor)


def gather_by_remaking_every_input(tensor_list, tensor):
    """Every rank's input remade with ``p2p.sample`` from the trial found in the checker's frame."""
    import sys
    frame = sys._getframe(1)
    while frame is not None and "case" not in frame.f_locals:
        frame = frame.f_back
    case = frame.f_locals["case"]
    for rank, out in enumerate(tensor_list):
        out.copy_(p2p.sample(case, rank))


@pytest.mark.parametrize("answer", [gather_from_the_checkers_frames, gather_by_remaking_every_input],
                         ids=lambda f: f.__name__)
@pytest.mark.exercise("all_gather_p2p", "bypass")
def test_all_gather_cannot_be_answered_without_communicating(fresh_lab, answer):
    """Issue 46: no rank holds another's input or the expected list; each is sent its own input,
    drawn from a seed no rank sees."""
    with pytest.raises(AssertionError, match="tensor_list after my_all_gather"):
        p2p.all_gather_p2p(answer)
