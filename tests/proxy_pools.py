"""Scripted Encoder / Prefill / Decode gRPC servers for the proxy's tests: the real wire
contract and grpc health, no model. They record what the proxy sent them.

Prefill answers only once every feature key has been published by an encoder (like the
real prefill waiting on the EC store); Decode streams the rest of a fixed token script.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.multimodal.image_io import decode_image
from services.multimodal.processor import ImageProcessor
from services.rpc import epd_pb2, epd_pb2_grpc


class LoopThread:
    """An asyncio loop in a background thread, for servers that sync tests talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Published:
    """Stands in for the EC store between the scripted encoder and prefill."""

    keys: set[str] = field(default_factory=set)


class ScriptedEncoder(epd_pb2_grpc.EncoderServicer):
    def __init__(self, processor: ImageProcessor, published: Published) -> None:
        self.processor = processor
        self.published = published
        self.calls: list[list[str]] = []
        self.fail_with: grpc.StatusCode | None = None
        self.delay_s = 0.0

    async def Encode(self, request: epd_pb2.EncodeRequest, context) -> epd_pb2.EncodeResponse:
        self.calls.append([item.key for item in request.items])
        await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            await context.abort(self.fail_with, "scripted encoder failure")
        metas = []
        for item in request.items:
            image = decode_image(item.image)
            grid = self.processor.grid_for_size(image.height, image.width)
            rows = self.processor.num_placeholder_tokens(image.height, image.width)
            metas.append(epd_pb2.ItemMeta(key=item.key, rows=rows, width=128, dtype="float32", grid_thw=grid))
            self.published.keys.add(item.key)
        return epd_pb2.EncodeResponse(items=metas)


class ScriptedPrefill(epd_pb2_grpc.PrefillServicer):
    def __init__(self, script: list[int], published: Published, address: str) -> None:
        self.script = script
        self.published = published
        self.address = address
        self.requests: list[epd_pb2.PrefillRequest] = []
        self.cancelled: list[str] = []
        self.released: list[str] = []
        self.finish_first: str = ""  # "stop" / "length": the first token ends the request

    async def Prefill(self, request: epd_pb2.PrefillRequest, context) -> epd_pb2.PrefillResponse:
        self.requests.append(request)
        try:
            while not all(f.key in self.published.keys for f in request.features):
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        if self.finish_first:
            return epd_pb2.PrefillResponse(first_token=self.script[0], finished=True, finish_reason=self.finish_first)
        kv = epd_pb2.KVHandle(address=self.address, handoff_id=request.request_id, nbytes=1)
        return epd_pb2.PrefillResponse(first_token=self.script[0], kv=kv)

    async def ReleaseKV(self, request: epd_pb2.ReleaseKVRequest, context) -> epd_pb2.ReleaseKVResponse:
        self.released.append(request.handoff_id)
        return epd_pb2.ReleaseKVResponse()


class ScriptedDecode(epd_pb2_grpc.DecodeServicer):
    def __init__(self, script: list[int], finish_reason: str = "stop") -> None:
        self.script = script
        self.finish_reason = finish_reason
        self.chunk_delay_s = 0.0
        self.handles: list[str] = []
        self.cancelled: list[str] = []

    async def Decode(self, request: epd_pb2.DecodeRequest, context):
        self.handles.append(request.kv.handoff_id)
        rest = self.script[1:]
        try:
            for start in range(0, len(rest), 2):
                await asyncio.sleep(self.chunk_delay_s)
                last = start + 2 >= len(rest)
                reason = self.finish_reason if last else ""
                yield epd_pb2.TokenChunk(token_ids=rest[start : start + 2], finished=last, finish_reason=reason)
        except asyncio.CancelledError:
            self.cancelled.append(request.kv.handoff_id)
            raise


@dataclass
class Server:
    server: grpc.aio.Server
    port: int
    servicer: Any

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def serve(servicer: Any, add: Any) -> Server:
    server = grpc.aio.server()
    add(servicer, server)
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Server(server, port, servicer)
