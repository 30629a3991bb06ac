"""The notebook-06 tree checker: a binomial tree passes, right sums that are no tree fail, and
messages sent with dist.batch_isend_irecv are followed (by the recursive-doubling checker too)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from allreduce_answers import NAIVE, RING, TREE, naive_without_broadcast

from ddplab.check.nb06_build_all_reduce import methods as check

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------ tree
def chain_all_reduce(tensor):
    """Right sums, but along a chain 3 -> 2 -> 1 -> 0 and back: p - 1 levels, not log2 p."""
    rank, p = dist.get_rank(), dist.get_world_size()
    inbox = torch.empty_like(tensor)
    if rank + 1 < p:
        dist.recv(inbox, src=rank + 1)
        tensor += inbox
    if rank:
        dist.send(tensor, dst=rank - 1)
        dist.recv(tensor, src=rank - 1)
    if rank + 1 < p:
        dist.send(tensor, dst=rank + 1)
    return tensor


def test_tree_checker_accepts_a_binomial_tree(fresh_lab4, capsys):
    check.tree_all_reduce(TREE)
    assert capsys.readouterr().out == (
        "Correct: tree_all_reduce matches dist.all_reduce on every rank for 41 cases, with 6 messages "
        "on 4 ranks up and down a tree 2 levels deep (each rank -> its parent: 1 -> 0, 2 -> 0, "
        "3 -> 2).\n")


@pytest.mark.parametrize("wrong, why", [
    (NAIVE, "rank 0 received 3 messages, one from every rank (a star"),
    (chain_all_reduce, "the tree is 3 levels deep (a chain)"),
    (RING, "24 messages were sent in all; a tree sends 2(p-1) = 6"),
])
def test_tree_checker_rejects_right_sums_that_are_no_tree(fresh_lab4, wrong, why):
    with pytest.raises(AssertionError) as info:
        check.tree_all_reduce(wrong)
    message = str(info.value)
    assert message.startswith("tree_all_reduce sums correctly on 4 ranks, but its messages do not "
                              "form a tree.\n"), message
    assert why in message and "Hint: reduce up a binomial tree" in message, message


def test_tree_checker_rejects_wrong_sums(fresh_lab4):
    with pytest.raises(AssertionError, match="tree_all_reduce is wrong on"):
        check.tree_all_reduce(naive_without_broadcast)


def test_tree_checker_says_when_it_cannot_see_the_messages(fresh_lab4):
    # Bound before the check could watch them. (A bound dist.send would still be
    # seen: torch's send calls the module's isend, which the check does watch.)
    real_isend, real_irecv = dist.isend, dist.irecv

    def send(tensor, peer):
        real_isend(tensor, peer).wait()

    def recv(tensor, peer):
        real_irecv(tensor, peer).wait()

    def tree_through_bound_names(tensor):
        rank, p = dist.get_rank(), dist.get_world_size()
        inbox, mask = torch.empty_like(tensor), 1
        while mask < p:
            if rank & mask:
                send(tensor, rank - mask)
                break
            if rank + mask < p:
                recv(inbox, rank + mask)
                tensor += inbox
            mask <<= 1
        lowest = rank & -rank
        if rank:
            recv(tensor, rank - lowest)
        mask = (lowest or 1 << (p - 1).bit_length()) >> 1
        while mask:
            if rank + mask < p:
                send(tensor, rank + mask)
            mask >>= 1
        return tensor

    with pytest.raises(AssertionError, match="none of its messages could be seen"):
        check.tree_all_reduce(tree_through_bound_names)


def tree_in_batches(tensor):
    """The binomial tree with every message sent as a one-op dist.batch_isend_irecv."""
    rank, p = dist.get_rank(), dist.get_world_size()

    def one(op, buffer, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, buffer, peer)]):
            work.wait()

    inbox, mask = torch.empty_like(tensor), 1
    while mask < p:
        if rank & mask:
            one(dist.isend, tensor, rank - mask)
            break
        if rank + mask < p:
            one(dist.irecv, inbox, rank + mask)
            tensor += inbox
        mask <<= 1
    lowest = rank & -rank
    if rank:
        one(dist.irecv, tensor, rank - lowest)
    mask = (lowest or 1 << (p - 1).bit_length()) >> 1
    while mask:
        if rank + mask < p:
            one(dist.isend, tensor, rank + mask)
        mask >>= 1
    return tensor


def test_tree_checker_follows_messages_sent_with_batch_isend_irecv(fresh_lab4, capsys):
    # batch_isend_irecv hands each op its peer as group_dst=/group_src=, not dst=/src=.
    check.tree_all_reduce(tree_in_batches)
    assert "6 messages on 4 ranks up and down a tree 2 levels deep" in capsys.readouterr().out


def doubling_in_batches(tensor):
    """Recursive doubling whose pairwise exchange is one dist.batch_isend_irecv, as often written."""
    rank, p = dist.get_rank(), dist.get_world_size()
    flat, q = tensor.view(-1), 1 << (p.bit_length() - 1)
    if rank >= q:
        dist.send(flat, dst=rank - q)
        dist.recv(flat, src=rank - q)
        return tensor
    inbox = torch.empty_like(flat)
    if rank + q < p:
        dist.recv(inbox, src=rank + q)
        flat += inbox
    mask = 1
    while mask < q:
        partner = rank ^ mask
        exchange = [dist.P2POp(dist.isend, flat, partner), dist.P2POp(dist.irecv, inbox, partner)]
        for work in dist.batch_isend_irecv(exchange):
            work.wait()
        flat += inbox
        mask <<= 1
    if rank + q < p:
        dist.send(flat, dst=rank + q)
    return tensor


def test_checkers_accept_p2p_ops_in_batches_on_three_of_four_ranks_too(fresh_lab4, capsys):
    # The check's own stand-ins for isend/irecv must be the ones P2POp accepts.
    check.recursive_doubling_all_reduce(doubling_in_batches)
    assert capsys.readouterr().out.startswith(
        "Correct: recursive_doubling_all_reduce matches dist.all_reduce on every rank for 41 cases "
        "on 4 ranks, and on 3 of them")
