"""Builds the PD worker: one engine (role "pd"), one KV pool, Prefill and Decode on one port."""

from __future__ import annotations

from functools import partial

from services.common.ec_store import open_store
from services.common.engine_factory import load_engine
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import Mounted, run
from services.common.settings import PDSettings
from services.decode import metrics as decode_metrics
from services.decode.kv_pull import KVPuller
from services.engine.llm_engine import LLMEngine
from services.pd.servicer import PDDecodeServicer
from services.prefill import metrics as prefill_metrics
from services.prefill.handoffs import HeldHandoffs
from services.prefill.servicer import PrefillServicer
from services.rpc import epd_pb2_grpc

LABEL = "epd-pd"


def serve(settings: PDSettings) -> None:
    run(LABEL, settings, partial(_build, settings))


def _observe(engine: LLMEngine) -> None:
    prefill_metrics.observe(engine)
    decode_metrics.observe(engine)


async def _build(settings: PDSettings) -> Mounted:
    store = open_store(settings)
    engine = EngineLoop(load_engine(settings, "pd", store), _observe)
    engine.start()
    handoffs = HeldHandoffs(engine, settings.kv_hold_timeout_s)
    puller = KVPuller(settings.kv_pull_timeout_s)
    prefill = PrefillServicer(engine, handoffs, settings.advertise, settings.kv_chunk_bytes)
    decode = PDDecodeServicer(engine, puller, handoffs, settings.advertise)

    async def close() -> None:
        await puller.close()
        handoffs.release_all()
        engine.stop()
        store.close()

    services = [
        ("Prefill", partial(epd_pb2_grpc.add_PrefillServicer_to_server, prefill)),
        ("Decode", partial(epd_pb2_grpc.add_DecodeServicer_to_server, decode)),
    ]
    return Mounted(services, close)
