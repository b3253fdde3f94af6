"""Block bookkeeping: one id space, tables grow to cover slots, free returns everything."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_runner import ScriptedRunner, drive, make_request, make_scheduler, script_for

from engine.block_manager import BlockManager


def test_grow_covers_slots_with_distinct_blocks() -> None:
    bm = BlockManager(10, 4)
    table: list[int] = []
    assert bm.blocks_needed(table, 0) == 0
    assert bm.blocks_needed(table, 1) == 1
    assert bm.blocks_needed(table, 4) == 1
    assert bm.blocks_needed(table, 5) == 2
    bm.grow(table, 9)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.grow(table, 12)  # already covered
    assert len(table) == 3
    bm.grow(table, 13)
    assert len(table) == 4
    other: list[int] = []
    bm.grow(other, 16)
    assert not set(table) & set(other)
    assert all(0 <= b < 10 for b in table + other)


def test_cannot_grow_past_free_blocks() -> None:
    bm = BlockManager(3, 4)
    table: list[int] = []
    assert bm.can_grow(table, 12)
    assert not bm.can_grow(table, 13)
    with pytest.raises(RuntimeError, match="Out of KV blocks"):
        bm.grow(table, 13)
    assert table == [] and bm.num_free_blocks == 3  # nothing leaked by the failed grow


def test_free_returns_all_and_clears_table() -> None:
    bm = BlockManager(6, 2)
    a, b = [], []
    bm.grow(a, 5)
    bm.grow(b, 4)
    bm.free(a)
    assert a == [] and bm.num_used_blocks == 2
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.usage == 0.0
    c: list[int] = []
    bm.grow(c, 12)  # every block usable again
    assert sorted(c) == list(range(6))


def test_double_free_is_detected() -> None:
    bm = BlockManager(4, 2)
    table: list[int] = []
    bm.grow(table, 2)
    copy = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(copy)


def test_zero_blocks_rejected() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20)), max_size=40))
def test_random_grow_free_keeps_accounting(ops) -> None:
    bm = BlockManager(12, 4)
    tables: list[list[int]] = [[] for _ in range(4)]
    for who, slots in ops:
        t = tables[who]
        if slots == 0:
            bm.free(t)
        elif bm.can_grow(t, slots):
            bm.grow(t, slots)
            assert len(t) * 4 >= slots
        used = [b for t in tables for b in t]
        assert len(used) == len(set(used)) == bm.num_used_blocks
    for t in tables:
        bm.free(t)
    assert bm.num_used_blocks == 0


# --------------------------------------------------------------------------- with the scheduler


def test_finished_requests_free_their_blocks() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4)
    rids = ["a", "bb", "ccc"]
    for i, rid in enumerate(rids):
        sched.add(make_request(rid, 5 + 3 * i, max_tokens=6))
    runner = ScriptedRunner({r: script_for(r) for r in rids}, block_size=4)
    peak = []
    drive(sched, runner, each_step=lambda plan: peak.append(sched.blocks.num_used_blocks))
    assert max(peak) > 0
    assert sched.blocks.num_used_blocks == 0
    assert not sched.running and not sched.waiting


def test_abort_frees_blocks_running_and_waiting() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=1)
    a, b = make_request("a", 9, max_tokens=20), make_request("b", 3, max_tokens=20)
    sched.add(a)
    sched.add(b)
    runner = ScriptedRunner({"a": script_for("a"), "b": script_for("b")}, block_size=4)
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
    assert a in sched.running and b in sched.waiting
    assert sched.blocks.num_used_blocks == len(a.block_table) > 0
    assert sched.abort("a") is a
    assert a.finish_reason == "abort" and a.is_finished and a.block_table == []
    assert sched.blocks.num_used_blocks == 0
    assert sched.abort("b") is b
    assert b.finish_reason == "abort"
    assert not sched.has_unfinished()
    assert sched.abort("b") is None  # unknown id now
    assert sched.blocks.num_used_blocks == 0
