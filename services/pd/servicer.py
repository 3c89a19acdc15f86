"""Decode on a PD worker: KV this worker holds is resumed in place, other KV is pulled."""

from __future__ import annotations

from services.common.engine_loop import EngineLoop, RequestStream
from services.common.errors import HandoffNotFoundError
from services.decode.kv_pull import KVPuller
from services.decode.servicer import DecodeServicer
from services.engine.llm_engine import LLMEngine
from services.prefill.handoffs import HeldHandoffs
from services.rpc import epd_pb2


class PDDecodeServicer(DecodeServicer):
    def __init__(self, engine: EngineLoop, puller: KVPuller, handoffs: HeldHandoffs, own_address: str) -> None:
        super().__init__(engine, puller)
        self._handoffs = handoffs
        self._own_address = own_address

    async def _open(self, kv: epd_pb2.KVHandle) -> RequestStream:
        # Handoff ids are random UUIDs, so one held here is ours under any alias of our address.
        if kv.address != self._own_address and not self._handoffs.holds(kv.handoff_id):
            return await super()._open(kv)
        request_id = self._handoffs.take(kv.handoff_id)

        def start(engine: LLMEngine) -> None:
            try:
                engine.resume(request_id)
            except KeyError as exc:
                raise HandoffNotFoundError(f"KV handoff {kv.handoff_id!r}: {exc.args[0]}") from None

        return await self._engine.open(request_id, start)
