"""The Encoder gRPC service: check each item's key, skip what the store has, batch the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from PIL import Image

from connectors.ec import ECStore
from services.encoder import metrics
from services.encoder.batcher import EncodeBatcher
from services.encoder.stage import EncoderStage, ItemMeta
from services.engine.sequence import RequestError
from services.multimodal.image_io import decode_image
from services.rpc import epd_pb2, epd_pb2_grpc


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    def __init__(self, stage: EncoderStage, store: ECStore, batcher: EncodeBatcher) -> None:
        self._stage = stage
        self._store = store
        self._batcher = batcher

    async def Encode(self, request: epd_pb2.EncodeRequest, context) -> epd_pb2.EncodeResponse:
        metrics.REQUESTS.inc()
        images = await asyncio.to_thread(self._checked_images, request.items)
        unique = {item.key: (image, patches) for item, (image, patches) in zip(request.items, images)}
        metas = await asyncio.gather(*(self._meta(key, image, patches) for key, (image, patches) in unique.items()))
        by_key = dict(zip(unique, metas))
        return epd_pb2.EncodeResponse(items=[_to_proto(by_key[item.key]) for item in request.items])

    def _checked_images(self, items: Sequence[epd_pb2.EncodeItem]) -> list[tuple[Image.Image, int]]:
        """Decoded images and their patch counts; every given key must be the image's content key."""
        out = []
        for i, item in enumerate(items):
            try:
                image = decode_image(item.image)
                patches = self._stage.patches(image)
            except ValueError as exc:
                raise RequestError(f"item {i}: {exc}") from None
            key = self._stage.key_for(image)
            if item.key != key:
                raise RequestError(
                    f"item {i}: key {item.key!r} is not the content key of its image ({key!r} for model "
                    f"{self._stage.model_id} with this encoder's processor settings); compute keys with "
                    "services.multimodal.content_key from the decoded image, the same model and processor config"
                )
            out.append((image, patches))
        return out

    async def _meta(self, key: str, image: Image.Image, patches: int) -> ItemMeta:
        future = self._batcher.in_flight(key)
        if future is None:
            if await asyncio.to_thread(self._store.exists, key):
                metrics.ITEMS.labels(result="cached").inc()
                return self._stage.cached_meta(key, image)
            future = self._batcher.encode(key, image, patches)
        return await asyncio.shield(future)  # other callers may be waiting on the same encode


def _to_proto(meta: ItemMeta) -> epd_pb2.ItemMeta:
    return epd_pb2.ItemMeta(
        key=meta.key, rows=meta.rows, width=meta.width, dtype=meta.dtype, grid_thw=meta.grid_thw, cached=meta.cached
    )
