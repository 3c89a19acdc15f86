"""Builds the decode service: engine (role "decode") on its thread, KV puller, servicer."""

from __future__ import annotations

from functools import partial

from services.common.engine_factory import load_engine
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import Mounted, run
from services.common.settings import DecodeSettings
from services.decode import metrics
from services.decode.kv_pull import KVPuller
from services.decode.servicer import DecodeServicer
from services.rpc import epd_pb2_grpc

LABEL = "epd-decode"


def serve(settings: DecodeSettings) -> None:
    run(LABEL, settings, partial(_build, settings))


async def _build(settings: DecodeSettings) -> Mounted:
    engine = EngineLoop(load_engine(settings, "decode"), metrics.observe)
    engine.start()
    puller = KVPuller(settings.kv_pull_timeout_s)
    servicer = DecodeServicer(engine, puller)

    async def close() -> None:
        await puller.close()
        engine.stop()

    return Mounted([("Decode", partial(epd_pb2_grpc.add_DecodeServicer_to_server, servicer))], close)
