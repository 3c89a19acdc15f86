"""The Decode gRPC service: pull the KV, join the running batch, stream tokens.

The first token came back with Prefill; this streams the ones after it. The
prefill server is told to free its copy once this engine has taken the KV in.
Leaving the stream early (caller cancelled) aborts the request in the engine.
"""

from __future__ import annotations

from services.common.convert import finish_reason
from services.common.engine_loop import EngineLoop, RequestStream
from services.decode import metrics
from services.decode.kv_pull import KVPuller
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import RequestError
from services.rpc import epd_pb2, epd_pb2_grpc


class DecodeServicer(epd_pb2_grpc.DecodeServicer):
    def __init__(self, engine: EngineLoop, puller: KVPuller) -> None:
        self._engine = engine
        self._puller = puller

    async def Decode(self, request: epd_pb2.DecodeRequest, context):
        metrics.REQUESTS.inc()
        kv = request.kv
        if not kv.address or not kv.handoff_id:
            raise RequestError("kv.address and kv.handoff_id are required (the KVHandle that Prefill returned)")
        async with await self._open(kv) as outputs:
            async for out in outputs:
                metrics.GENERATED_TOKENS.inc(len(out.new_token_ids))
                yield epd_pb2.TokenChunk(
                    token_ids=out.new_token_ids, finished=out.finished, finish_reason=finish_reason(out.finish_reason)
                )

    async def _open(self, kv: epd_pb2.KVHandle) -> RequestStream:
        """Pull the KV over the network and hand it to the engine."""
        handoff = await self._puller.pull(kv)

        def start(engine: LLMEngine) -> None:
            engine.add_handoff(handoff)

        stream = await self._engine.open(handoff.state.request_id, start)
        self._puller.release_soon(kv)
        return stream
