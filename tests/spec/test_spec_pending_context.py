"""Draft context writes that wait while nobody drafts: order kept, the newest write of a slot
wins (a page reused while writes waited)."""

from __future__ import annotations

import torch

from engine.spec.dflash import PendingContext


def test_pending_context_keeps_order_and_the_newest_write_of_a_slot() -> None:
    pending = PendingContext()
    assert pending.num_tokens == 0
    pending.add(torch.tensor([[1.0], [2.0], [3.0]]), [0, 1, 2], [10, 11, 12])
    pending.add(torch.tensor([[4.0], [5.0]]), [0, 3], [11, 13])  # slot 11 reused
    assert pending.num_tokens == 5
    hidden, pos, slots = pending.take()
    assert slots == [10, 12, 11, 13] and pos == [0, 2, 0, 3]
    assert hidden.flatten().tolist() == [1.0, 3.0, 4.0, 5.0]
    assert pending.num_tokens == 0


def test_pending_context_without_reuse_is_the_concatenation() -> None:
    pending = PendingContext()
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    pending.add(a, [5, 6], [5, 6])
    pending.add(b, [7, 0, 1], [7, 20, 21])
    hidden, pos, slots = pending.take()
    assert torch.equal(hidden, torch.cat([a, b]))
    assert pos == [5, 6, 7, 0, 1] and slots == [5, 6, 7, 20, 21]
