"""Fixed-size KV blocks: a free list, per-sequence block tables, admission by reservation.

A sequence is admitted only if the blocks for its worst case (prompt + max_tokens)
fit beside everything already promised, so a running sequence never runs out of
blocks and nothing has to be preempted. Blocks are allocated lazily as tokens
arrive; the unallocated rest of the promise is counted in `reserved`.
"""

from __future__ import annotations

from collections import deque

from services.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.reserved = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_available(self) -> int:
        """Free blocks not promised to an admitted sequence."""
        return len(self.free) - self.reserved

    def can_admit(self, seq: Sequence) -> bool:
        return self.blocks_for(seq.max_total_tokens) <= self.num_available

    def admit(self, seq: Sequence, num_tokens: int) -> None:
        """Allocate blocks for the first `num_tokens` and reserve the rest of the worst case."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        total = self.blocks_for(seq.max_total_tokens)
        assert total <= self.num_available, "admit() without can_admit()"
        seq.block_table = [self.free.popleft() for _ in range(self.blocks_for(num_tokens))]
        seq.reserved_blocks = total - len(seq.block_table)
        self.reserved += seq.reserved_blocks

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table so it covers `num_tokens`, drawing on the reservation."""
        while len(seq.block_table) < self.blocks_for(num_tokens):
            assert seq.reserved_blocks > 0, f"{seq.request_id} grew past its reservation"
            seq.reserved_blocks -= 1
            self.reserved -= 1
            seq.block_table.append(self.free.popleft())

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        self.reserved -= seq.reserved_blocks
        seq.block_table, seq.reserved_blocks = [], 0
