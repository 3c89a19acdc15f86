"""Decode stage: takes KV handoffs into its running batch and produces tokens.

Holds only the language model and its own paged KV pool; continuous batching
lets handed-off requests join between steps.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from connectors.kv import KVHandoff
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import StepOutput
from services.models.checkpoint import Checkpoint


class DecodeStage:
    def __init__(self, checkpoint: str | Path | Checkpoint, config: EngineConfig) -> None:
        self.engine = LLMEngine(checkpoint, replace(config, role="decode"))

    def accept(self, handoff: KVHandoff) -> None:
        self.engine.add_handoff(handoff)

    def step(self) -> list[StepOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()
