"""Decides what runs next: a prefill batch of ready prompts, else one decode step of all running.

Prompts whose embeddings are not yet in the EC store stay in the queue without
holding up the prompts behind them; one that waits past its deadline fails.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class Batch:
    kind: Literal["prefill", "decode"]
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, is_ready: Callable[[Sequence], bool]) -> None:
        self.config = config
        self.blocks = blocks
        self.is_ready = is_ready
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def expired(self, now: float | None = None) -> list[Sequence]:
        """Waiting prompts whose embeddings did not arrive in time; removed from the queue."""
        now = time.monotonic() if now is None else now
        late = [s for s in self.waiting if s.feature_deadline < now and not self.is_ready(s)]
        for seq in late:
            self.waiting.remove(seq)
        return late

    def schedule(self) -> Batch | None:
        prefill = self._admit_prompts()
        if prefill:
            return Batch("prefill", prefill)
        if self.running:
            return Batch("decode", list(self.running))
        return None

    def _admit_prompts(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        for seq in list(self.waiting):
            if len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            if not self.is_ready(seq):
                continue  # embeddings still in flight: let the others go first
            tokens = len(seq.prompt_ids)
            if admitted and tokens > budget:
                break
            if not self.blocks.can_admit(seq):
                break  # keep FIFO order for memory; retry next step
            self.blocks.admit(seq, tokens)
            self.waiting.remove(seq)
            admitted.append(seq)
            budget -= tokens
        return admitted

    def start_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED
