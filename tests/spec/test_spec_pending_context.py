"""Draft context writes wait per request until the request drafts: a request's states keep
their order and get its slots when taken, and a finished or preempted request's states are
dropped unwritten (its pages may belong to another request by the time anything is written)."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.spec.dflash import PendingContext

BS = 4  # block size


def _request(rid: str, table: list[int]) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))
    req.block_table = table
    return req


def test_a_requests_states_keep_their_order_and_leave_when_taken() -> None:
    a, b = _request("a", [5, 2]), _request("b", [7])
    pending = PendingContext()
    assert pending.num_tokens == 0 and pending.num_bytes == 0 and pending.take(BS) is None
    ha, hb, ha2 = torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 4)
    pending.add(a, ha, 0)
    pending.add(b, hb, 1)
    pending.add(a, ha2, 3)
    assert pending.num_tokens == 7 and pending.num_bytes == 7 * 4 * 4
    hidden, pos, slots = pending.take(BS, ["a"])
    assert torch.equal(hidden, torch.cat([ha, ha2]))
    assert pos == [0, 1, 2, 3, 4] and slots == [20, 21, 22, 23, 8]  # blocks 5 then 2
    assert pending.num_tokens == 2 and pending.num_bytes == 2 * 4 * 4
    assert pending.take(BS, ["a"]) is None  # nothing waits for it any more
    hidden, pos, slots = pending.take(BS)
    assert torch.equal(hidden, hb) and pos == [1, 2] and slots == [29, 30]
    assert pending.num_tokens == 0 and pending.num_bytes == 0


def test_a_gap_in_a_requests_positions_is_an_error() -> None:
    a = _request("a", [0])
    pending = PendingContext()
    pending.add(a, torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="at 3, expected 2"):
        pending.add(a, torch.zeros(1, 3), 3)


def test_finished_and_preempted_requests_are_dropped_unwritten() -> None:
    done, preempted, live = _request("done", [0]), _request("pre", [1]), _request("live", [2])
    pending = PendingContext()
    for i, req in enumerate((done, preempted, live)):
        pending.add(req, torch.full((2, 3), float(i)), 0)
    done.status = RequestStatus.FINISHED
    preempted.num_preemptions += 1  # its pages were freed; a recompute adds its states again
    pending.prune()
    hidden, pos, slots = pending.take(BS)
    assert torch.equal(hidden, torch.full((2, 3), 2.0)) and slots == [8, 9]
    # states computed after the preemption belong to the recomputed request and are kept
    preempted.block_table = [6]
    pending.add(preempted, torch.ones(1, 3), 0)
    pending.prune()
    assert pending.take(BS, ["pre"])[2] == [24]


def test_states_from_before_a_preemption_are_replaced_when_the_recompute_adds_again() -> None:
    req = _request("a", [3])
    pending = PendingContext()
    pending.add(req, torch.zeros(3, 2), 0)
    req.num_preemptions += 1
    req.block_table = [4]
    pending.add(req, torch.ones(2, 2), 0)  # no prune in between
    assert pending.num_tokens == 2 and pending.num_bytes == 2 * 2 * 4
    hidden, pos, slots = pending.take(BS)
    assert torch.equal(hidden, torch.ones(2, 2)) and pos == [0, 1] and slots == [16, 17]


def test_a_new_request_under_a_used_id_starts_afresh() -> None:
    old, new = _request("a", [1]), _request("a", [2])
    pending = PendingContext()
    pending.add(old, torch.zeros(3, 2), 0)
    pending.add(new, torch.ones(1, 2), 0)
    hidden, pos, slots = pending.take(BS)
    assert torch.equal(hidden, torch.ones(1, 2)) and slots == [8]


def test_a_steps_states_are_held_whole_while_any_request_holds_rows_of_them() -> None:
    """One copy per step: the requests' rows are views of it, and the memory counted is
    the step's states whole until the last request holding rows of them is done."""
    a, b = _request("a", [1, 2]), _request("b", [3])
    pending = PendingContext()
    step = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)  # a: rows 0-3, b: row 4
    pending.add_step(step, [(a, 0, 0, 4), (b, 4, 2, 1)])
    later = torch.full((1, 2), -1.0)
    pending.add_step(later, [(a, 0, 4, 1)])
    assert pending.num_tokens == 6 and pending.num_bytes == (5 + 1) * 2 * 4
    hidden, pos, slots = pending.take(BS, ["a"])
    assert torch.equal(hidden, torch.cat([step[:4], later])) and pos == [0, 1, 2, 3, 4]
    assert slots == [4, 5, 6, 7, 8]
    assert pending.num_bytes == 5 * 2 * 4  # b's one row keeps its step's states
    hidden, pos, slots = pending.take(BS)
    assert torch.equal(hidden, step[4:]) and pos == [2] and slots == [14]
    assert pending.num_bytes == 0 and pending.num_tokens == 0
