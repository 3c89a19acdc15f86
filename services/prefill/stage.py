"""Prefill stage: token ids + feature specs in, first token + KV handoff out.

Holds only the language model. Embeddings come from the EC store by key; a
prompt whose embeddings are still missing waits without holding up the others.
A handed-off request keeps its KV blocks until `confirm` (or `abandon`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from connectors.ec import ECConsumer
from connectors.kv import KVHandoff
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import FeatureSpec, FinishReason, SamplingParams
from services.models.checkpoint import Checkpoint


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int | None
    handoff: KVHandoff | None  # None if the request ended at its first token or failed
    finish_reason: FinishReason | None = None
    error: str | None = None


class PrefillStage:
    def __init__(self, checkpoint: str | Path | Checkpoint, config: EngineConfig, store: ECConsumer) -> None:
        self.engine = LLMEngine(checkpoint, replace(config, role="prefill"), store)

    def submit(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, features: Iterable[FeatureSpec] = ()
    ) -> None:
        self.engine.add_request(request_id, prompt_ids, sampling, features)

    def step(self) -> list[PrefillResult]:
        results = []
        for out in self.engine.step():
            token = out.new_token_ids[0] if out.new_token_ids else None
            handoff = None if out.finished else self.engine.export_handoff(out.request_id)
            results.append(PrefillResult(out.request_id, token, handoff, out.finish_reason, out.error))
        return results

    def confirm(self, request_id: str) -> None:
        """The decode side has the KV: free the blocks here."""
        self.engine.release_handoff(request_id)

    abandon = confirm  # the transfer failed or timed out: the blocks are freed all the same

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()
