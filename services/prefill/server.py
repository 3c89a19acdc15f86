"""Builds the prefill service: EC store, engine (role "prefill") on its thread, servicer."""

from __future__ import annotations

from functools import partial

from services.common.ec_store import open_store
from services.common.engine_factory import load_engine
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import Mounted, run
from services.common.settings import PrefillSettings
from services.prefill import metrics
from services.prefill.handoffs import HeldHandoffs
from services.prefill.servicer import PrefillServicer
from services.rpc import epd_pb2_grpc

LABEL = "epd-prefill"


def serve(settings: PrefillSettings) -> None:
    run(LABEL, settings, partial(_build, settings))


async def _build(settings: PrefillSettings) -> Mounted:
    store = open_store(settings)
    engine = EngineLoop(load_engine(settings, "prefill", store), metrics.observe)
    engine.start()
    handoffs = HeldHandoffs(engine, settings.kv_hold_timeout_s)
    servicer = PrefillServicer(engine, handoffs, settings.advertise, settings.kv_chunk_bytes)

    async def close() -> None:
        handoffs.release_all()
        engine.stop()
        store.close()

    return Mounted([("Prefill", partial(epd_pb2_grpc.add_PrefillServicer_to_server, servicer))], close)
