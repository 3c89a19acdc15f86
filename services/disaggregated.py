"""The whole E -> P -> D path in one process, for tests and benchmarks.

Encoder publishes to the EC store; prefill reads embeddings by key (never pixels);
the KV handoff crosses as bytes into a separate decode engine with its own pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from connectors.ec import ECStore
from connectors.kv import KVHandoff
from services.decode.stage import DecodeStage
from services.encoder.stage import EncoderStage
from services.engine.config import EngineConfig
from services.engine.sequence import FinishReason, SamplingParams
from services.multimodal.prompt import PromptBuilder
from services.prefill.stage import PrefillStage


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None


class InProcessEPD:
    def __init__(self, checkpoint: str | Path, store: ECStore, engine: EngineConfig = EngineConfig()) -> None:
        self.store = store
        self.encoder = EncoderStage(checkpoint, store, device=engine.device, dtype=engine.torch_dtype)
        self.prefill = PrefillStage(checkpoint, engine, store)
        self.decode = DecodeStage(checkpoint, engine)
        self.prompts = PromptBuilder(checkpoint, self.encoder.processor, self.encoder.model_id)

    def generate(self, requests: Sequence[tuple[Sequence[Mapping], SamplingParams]]) -> list[Completion]:
        results: dict[str, Completion] = {}
        for i, (messages, sampling) in enumerate(requests):
            prompt = self.prompts.build(messages)
            if prompt.images:
                self.encoder.encode_and_publish(prompt.images)
            self.prefill.submit(str(i), prompt.token_ids, sampling, prompt.features)
            results[str(i)] = Completion()
        while self.prefill.has_unfinished() or self.decode.has_unfinished():
            self._prefill_step(results)
            self._decode_step(results)
        return [results[str(i)] for i in range(len(requests))]

    def _prefill_step(self, results: dict[str, Completion]) -> None:
        for out in self.prefill.step():
            done = results[out.request_id]
            done.token_ids += [out.first_token] if out.first_token is not None else []
            done.finish_reason, done.error = out.finish_reason, out.error
            if out.handoff is not None:
                # Through the wire form, as a network transport would carry it.
                self.decode.accept(KVHandoff.from_bytes(out.handoff.to_bytes()))
                self.prefill.confirm(out.request_id)

    def _decode_step(self, results: dict[str, Completion]) -> None:
        if not self.decode.has_unfinished():
            return
        for out in self.decode.step():
            done = results[out.request_id]
            done.token_ids += out.new_token_ids
            done.finish_reason, done.error = out.finish_reason, out.error
