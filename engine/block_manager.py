"""Pure-Python KV block bookkeeping: one block-id space shared by every attention group."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out block ids with reference counts; block tables are per-request lists.

    A request's table grows to cover ``num_slots`` positions (its length plus any look-ahead
    for draft tokens) and shrinks only when the request is freed: rejected draft positions
    are rolled back by length, and their slots are overwritten by later writes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, table: list[int], num_slots: int) -> int:
        """Extra blocks ``table`` needs to hold ``num_slots`` positions."""
        want = -(-num_slots // self.block_size)
        return max(0, want - len(table))

    def can_grow(self, table: list[int], num_slots: int) -> bool:
        return self.blocks_needed(table, num_slots) <= len(self._free)

    def grow(self, table: list[int], num_slots: int) -> None:
        """Append blocks to ``table`` (in place) so it covers ``num_slots`` positions."""
        need = self.blocks_needed(table, num_slots)
        if need > len(self._free):
            raise RuntimeError(f"Out of KV blocks: need {need}, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._ref[block] = 1
            table.append(block)

    def free(self, table: list[int]) -> None:
        """Release every block of ``table`` and clear it."""
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free.append(block)
            elif self._ref[block] < 0:
                raise RuntimeError(f"Block {block} freed twice")
        table.clear()
