"""Builds the encoder service: EC store, vision tower, batcher, servicer."""

from __future__ import annotations

from functools import partial

import torch

from services.common.ec_store import open_store
from services.common.grpc_server import Mounted, run
from services.common.settings import EncoderSettings
from services.encoder.batcher import EncodeBatcher
from services.encoder.servicer import EncoderServicer
from services.encoder.stage import EncoderStage
from services.rpc import epd_pb2_grpc

LABEL = "epd-encoder"


def serve(settings: EncoderSettings) -> None:
    run(LABEL, settings, partial(_build, settings))


async def _build(settings: EncoderSettings) -> Mounted:
    store = open_store(settings)
    stage = EncoderStage(
        settings.checkpoint, store, settings.device, getattr(torch, settings.dtype), settings.max_batch_patches
    )
    batcher = EncodeBatcher(stage, settings.max_batch_patches, settings.batch_wait_ms / 1000)
    batcher.start()
    servicer = EncoderServicer(stage, store, batcher)

    async def close() -> None:
        await batcher.stop()
        store.close()

    return Mounted([("Encoder", partial(epd_pb2_grpc.add_EncoderServicer_to_server, servicer))], close)
