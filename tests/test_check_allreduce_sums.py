"""The notebook-06 checkers accept right ring, naive and recursive-doubling all_reduces and
reject wrong ones: wrong sums, messages that are no ring, a deadlock. The tree checker's tests are
in test_check_allreduce_tree.py, the answers refused however they sum in _refusals.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from allreduce_answers import NAIVE, NAIVE_COLLECTIVES, RECURSIVE_DOUBLING, RING, naive_without_broadcast

from ddplab.check.nb06_build_all_reduce import methods as check

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- wrong answers
def ring_same_formula_in_both_phases(tensor):
    """Wrong chunk order: the all-gather reuses the reduce-scatter's chunk indexes."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(p)
    inbox = torch.empty_like(chunks[0])
    for step in range(p - 1):
        send, recv = (rank - step) % p, (rank - step - 1) % p
        request = dist.isend(chunks[send], dst=(rank + 1) % p)
        part = inbox[:chunks[recv].numel()]
        dist.recv(part, src=(rank - 1) % p)
        request.wait()
        chunks[recv].add_(part)
    for step in range(p - 1):
        send, recv = (rank - step) % p, (rank - step - 1) % p     # should be rank+1-step, rank-step
        request = dist.isend(chunks[send], dst=(rank + 1) % p)
        dist.recv(chunks[recv], src=(rank - 1) % p)
        request.wait()
    return tensor


def ring_without_all_gather(tensor):
    """Only the reduce-scatter: each rank ends with one finished chunk."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(p)
    inbox = torch.empty_like(chunks[0])
    for step in range(p - 1):
        send, recv = (rank - step) % p, (rank - step - 1) % p
        request = dist.isend(chunks[send], dst=(rank + 1) % p)
        part = inbox[:chunks[recv].numel()]
        dist.recv(part, src=(rank - 1) % p)
        request.wait()
        chunks[recv].add_(part)
    return tensor


def ring_equal_chunks_only(tensor):
    """Chunks of len // p elements: the last len % p elements are never reduced."""
    rank, p = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    size = flat.numel() // p
    chunks = [flat[i * size:(i + 1) * size] for i in range(p)]
    inbox = torch.empty(size, dtype=flat.dtype)
    for step in range(p - 1):
        send, recv = (rank - step) % p, (rank - step - 1) % p
        request = dist.isend(chunks[send], dst=(rank + 1) % p)
        dist.recv(inbox, src=(rank - 1) % p)
        request.wait()
        chunks[recv].add_(inbox)
    for step in range(p - 1):
        send, recv = (rank + 1 - step) % p, (rank - step) % p
        request = dist.isend(chunks[send], dst=(rank + 1) % p)
        dist.recv(chunks[recv], src=(rank - 1) % p)
        request.wait()
    return tensor


def returns_a_new_tensor(tensor):
    out = tensor.clone()
    dist.reduce(out, dst=0)
    dist.broadcast(out, src=0)
    return out


# ---------------------------------------------------------------- tests
def test_right_ring_passes_with_one_fixed_line(fresh_lab4, capsys):
    check.ring_all_reduce(RING)
    out = capsys.readouterr().out
    assert out == ("Correct: ring_all_reduce matches dist.all_reduce on every rank for 41 cases, and "
                   "each rank sent 6 chunks of 1/4 of the tensor to its right neighbour and "
                   "received 6 from its left one.\n")


def whole_tensor_round_the_ring(tensor):
    """Right sums, wrong method: the whole tensor goes round the ring p - 1 times."""
    rank, p = dist.get_rank(), dist.get_world_size()
    passing, inbox, total = tensor.clone(), torch.empty_like(tensor), tensor.clone()
    for _ in range(p - 1):
        receiving = dist.irecv(inbox, src=(rank - 1) % p)
        dist.isend(passing, dst=(rank + 1) % p).wait()
        receiving.wait()
        total += inbox
        passing = inbox.clone()
    tensor.copy_(total)
    return tensor


def test_the_ring_check_rejects_a_naive_all_reduce_that_sums_right(fresh_lab4):
    """The exercise teaches the ring: reduce-then-broadcast through rank 0 sums right, and fails."""
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(NAIVE)
    message = str(info.value)
    assert message.startswith("ring_all_reduce sums correctly on 4 ranks, but its messages are not "
                              "a ring's"), message
    assert ("rank 1 sent to rank 0; a ring only sends to its right neighbour, rank 2" in message
            or "rank 0 sent to rank 2, 3" in message), message
    assert "2(p-1) = 6 messages each way" in message and "Hint: cut the tensor" in message


def test_the_ring_check_rejects_whole_tensors_sent_round_the_ring(fresh_lab4):
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(whole_tensor_round_the_ring)
    message = str(info.value)
    assert "messages are not a ring's" in message
    assert "rank 0 made 3 send(s), 3 fewer than a ring's 2(p-1) = 6" in message   # made, expected, which way
    assert ("rank 0 sent messages of 16 elements; a ring moves chunks of 1/p of the tensor "
            "(4 of 16)") in message


def test_rejects_wrong_chunk_order(fresh_lab4):
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(ring_same_formula_in_both_phases)
    message = str(info.value)
    assert message.startswith("ring_all_reduce is wrong on ranks 0, 1, 2, 3 for shape=[")
    assert "compared with dist.all_reduce" in message
    assert "element " in message and "expected " in message and ", got " in message
    assert "Hint:" in message


def test_rejects_forgotten_all_gather(fresh_lab4):
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(ring_without_all_gather)
    message = str(info.value)
    # Length 1 on 4 ranks: the one element is in chunk 0, finished on rank 3 only.
    assert message.splitlines()[0] == (
        "ring_all_reduce is wrong on ranks 0, 1, 2 for shape=[1], dtype=float32, seed=0 "
        "(1 elements on 4 ranks, not a multiple of world_size); compared with dist.all_reduce.")
    assert "  rank 0: got 1 of 1 elements wrong" in message
    assert "  rank 0, element 0: expected " in message
    assert "rank 3: " not in message


def test_rejects_lengths_not_divisible_by_world_size(fresh_lab4):
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(ring_equal_chunks_only)
    message = str(info.value)
    assert "for shape=[1], dtype=float32, seed=0 (1 elements on 4 ranks, not a multiple" in message
    assert "more of the 41 cases are wrong too" in message


def test_equal_chunks_only_is_right_when_divisible(fresh_lab4, capsys):
    # The bug only shows on lengths that are not multiples of world_size:
    # which is why the checker tries those.
    divisible = [((n,), "float32", 0) for n in (4, 8, 1000)]
    check.check_all_reduce(ring_equal_chunks_only, "ring_all_reduce", case_list=divisible)
    assert capsys.readouterr().out.startswith("Correct:")


def test_naive_without_broadcast_names_the_ranks_that_are_wrong(fresh_lab4):
    with pytest.raises(AssertionError) as info:
        check.naive_all_reduce(naive_without_broadcast)
    first = str(info.value).splitlines()[0]
    assert first.startswith("naive_all_reduce is wrong on ranks 1, 2, 3 for ")


def ring_that_sends_first(tensor):
    """Every rank's blocking send waits for a receive nobody posts yet."""
    rank, p = dist.get_rank(), dist.get_world_size()
    inbox = torch.empty_like(tensor)
    for _ in range(p - 1):
        dist.send(tensor, dst=(rank + 1) % p)
        dist.recv(inbox, src=(rank - 1) % p)
    tensor += inbox
    return tensor


def test_the_deadlock_timeout_students_see_is_15_s():
    assert check.DEADLOCK_TIMEOUT == 15.0       # the hang tests below wait a shorter one


def test_a_deadlocked_ring_is_reported_within_the_check_timeout_with_a_hint(fresh_lab4, monkeypatch):
    import time

    monkeypatch.setattr(check, "DEADLOCK_TIMEOUT", 5.0)    # 15 s ends the hang the same way
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(ring_that_sends_first)
    took = time.monotonic() - start
    message = str(info.value)
    assert "did not finish: the ranks are waiting for each other (a deadlock)" in message
    assert "rank 0: still in send" in message
    assert "Hint: every rank is waiting in send" in message        # the hint of what the lab saw
    assert "dist.isend" in message and "lab.restart()" in message
    assert took < 3 * check.DEADLOCK_TIMEOUT          # not the lab's 60 s
    fresh_lab4.restart()


def ring_that_hangs_on_the_message_pass(tensor):
    """Right on every case, but deadlocked on the one tensor of 4p elements whose messages are followed."""
    if tensor.numel() == 4 * dist.get_world_size():
        return ring_that_sends_first(tensor)
    return RING(tensor)


def test_a_ring_deadlocked_while_its_messages_are_followed_says_so_within_the_timeout(fresh_lab4,
                                                                                   monkeypatch):
    monkeypatch.setattr(check, "DEADLOCK_TIMEOUT", 5.0)    # each right case takes well under 1 s
    with pytest.raises(AssertionError) as info:
        check.ring_all_reduce(ring_that_hangs_on_the_message_pass)
    message = str(info.value)
    fresh_lab4.restart()
    assert message.startswith("ring_all_reduce(tensor) on shape=[16], dtype=float32, its messages "
                              "followed did not finish: the ranks are waiting"), message
    assert "rank 0: still in send" in message
    assert "Hint: every rank is waiting in send" in message
    assert "lab.restart()" in message


def test_collectives_version_must_work_in_place(fresh_lab):
    check.naive_all_reduce_collectives(NAIVE_COLLECTIVES)
    with pytest.raises(AssertionError, match="returned a new tensor and left its argument unchanged"):
        check.naive_all_reduce_collectives(returns_a_new_tensor)


def test_recursive_doubling_checker(fresh_lab4, capsys):
    check.recursive_doubling_all_reduce(RECURSIVE_DOUBLING)
    assert capsys.readouterr().out.startswith("Correct: recursive_doubling_all_reduce")
    with pytest.raises(AssertionError):
        check.recursive_doubling_all_reduce(naive_without_broadcast)


def doubling_for_powers_of_two_only(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inbox = torch.empty_like(tensor)
    mask = 1
    while mask < world_size:                      # no first and last step for the extra ranks
        partner = rank ^ mask
        request = dist.isend(tensor, dst=partner)
        dist.recv(inbox, src=partner)
        request.wait()
        tensor += inbox
        mask <<= 1
    return tensor


def test_recursive_doubling_is_also_checked_on_three_of_four_ranks(fresh_lab4, capsys):
    check.recursive_doubling_all_reduce(RECURSIVE_DOUBLING)
    assert capsys.readouterr().out == (
        "Correct: recursive_doubling_all_reduce matches dist.all_reduce on every rank for 41 cases "
        "on 4 ranks, and on 3 of them (not a power of two).\n")
    with pytest.raises(AssertionError) as info:
        check.recursive_doubling_all_reduce(doubling_for_powers_of_two_only)
    message = str(info.value)
    assert message.startswith("recursive_doubling_all_reduce on 3 ranks is wrong on rank")
    assert "no rank 3" in message and "3 is not a power of two" in message
    assert not fresh_lab4.broken_reason                 # nobody was left waiting for rank 3


def test_the_students_stub_fails_naming_the_case(fresh_lab):
    def stub(tensor):
        raise NotImplementedError()

    with pytest.raises(AssertionError, match=r"(?s)^NotImplementedError \(.*line \d+, in stub\), on "
                                             r"ranks 0, 1\..*It raised while the check ran "
                                             r"ring_all_reduce\(tensor\) on shape=\[1\], dtype=float32\."):
        check.ring_all_reduce(stub)


def test_not_a_function_is_refused_with_the_fix(fresh_lab):
    with pytest.raises(AssertionError, match=r"ddplab.check.ring_all_reduce\(my_ring_all_reduce\)"):
        check.ring_all_reduce(None)
