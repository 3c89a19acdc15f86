"""The Prefill gRPC service: prompt in, first token + a handle on the held KV out.

A prompt waiting for its embeddings waits inside the engine; this RPC only
awaits its output queue, so other prompts go ahead. The KV stays in the
engine's blocks until ReleaseKV (or the hold timeout); PullKV exports it then.
"""

from __future__ import annotations

import asyncio
import time

from services.common.convert import features_from_proto, finish_reason, request_id_of, sampling_from_proto
from services.common.engine_loop import EngineLoop
from services.common.errors import HandoffNotFoundError
from services.engine.llm_engine import LLMEngine
from services.prefill import metrics
from services.prefill.handoffs import HeldHandoffs
from services.rpc import epd_pb2, epd_pb2_grpc


class PrefillServicer(epd_pb2_grpc.PrefillServicer):
    def __init__(self, engine: EngineLoop, handoffs: HeldHandoffs, advertise_address: str, chunk_bytes: int) -> None:
        self._engine = engine
        self._handoffs = handoffs
        self._address = advertise_address
        self._chunk_bytes = chunk_bytes

    async def Prefill(self, request: epd_pb2.PrefillRequest, context) -> epd_pb2.PrefillResponse:
        metrics.REQUESTS.inc()
        started = time.perf_counter()
        try:
            return await self._prefill(request)
        finally:
            metrics.SECONDS.observe(time.perf_counter() - started)

    async def _prefill(self, request: epd_pb2.PrefillRequest) -> epd_pb2.PrefillResponse:
        request_id = request_id_of(request.request_id)
        prompt = list(request.token_ids)
        sampling = sampling_from_proto(request.sampling)
        features = features_from_proto(request.features)

        def start(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, sampling, features)

        async with await self._engine.open(request_id, start) as outputs:
            metrics.PROMPT_TOKENS.inc(len(prompt))
            first = await outputs.next()
            if first.finished:
                return epd_pb2.PrefillResponse(
                    first_token=first.new_token_ids[0], finished=True, finish_reason=finish_reason(first.finish_reason)
                )
            outputs.keep()
            # Registered before the next await: from here on the hold timer frees the KV if all else fails.
            handoff_id = self._handoffs.hold(request_id)
        nbytes = await self._engine.call(lambda engine: engine.handoff_nbytes(request_id))
        kv = epd_pb2.KVHandle(address=self._address, handoff_id=handoff_id, nbytes=nbytes)
        return epd_pb2.PrefillResponse(first_token=first.new_token_ids[0], kv=kv)

    async def PullKV(self, request: epd_pb2.PullKVRequest, context):
        request_id = self._handoffs.request_of(request.handoff_id)
        handoff = await self._engine.call(lambda engine: _export(engine, request_id, request.handoff_id))
        data = memoryview(await asyncio.to_thread(handoff.to_bytes))
        for start in range(0, len(data), self._chunk_bytes):
            yield epd_pb2.KVChunk(data=bytes(data[start : start + self._chunk_bytes]))

    async def ReleaseKV(self, request: epd_pb2.ReleaseKVRequest, context) -> epd_pb2.ReleaseKVResponse:
        request_id = self._handoffs.take(request.handoff_id)
        await self._engine.call(lambda engine: engine.release_handoff(request_id))
        return epd_pb2.ReleaseKVResponse()


def _export(engine: LLMEngine, request_id: str, handoff_id: str):
    try:
        return engine.export_handoff(request_id)
    except KeyError:  # freed between the lookup and the export
        raise HandoffNotFoundError(f"KV handoff {handoff_id!r} was freed before it could be pulled") from None
