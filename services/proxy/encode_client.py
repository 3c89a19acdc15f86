"""Getting images' embeddings into the EC store: skip keys already there, send the rest in
one Encode RPC, share in-flight keys across requests, retry failures on other replicas.

Single-flight invariant: `_inflight[key]` exists exactly while one Encode task owns the
key; every request needing it awaits that future instead of sending the image again.
The task is not tied to the request that started it, so a client going away does not
cancel an encode that other requests wait for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence

import grpc

from connectors.ec import ECStore
from services.proxy.errors import StageError, stage_error
from services.proxy.metrics import ProxyMetrics
from services.proxy.replicas import ReplicaSet
from services.rpc import epd_pb2

log = logging.getLogger("epd.proxy")

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
_STORE_CHECK_TIMEOUT_S = 2.0


class EncodeClient:
    def __init__(self, encoders: ReplicaSet, store: ECStore | None, metrics: ProxyMetrics, retries: int) -> None:
        self.encoders = encoders
        self.store = store
        self.metrics = metrics
        self.retries = retries
        self._inflight: dict[str, asyncio.Future[epd_pb2.ItemMeta | None]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def ensure(
        self, request_id: str, items: Sequence[tuple[str, bytes]], deadline: float
    ) -> dict[str, epd_pb2.ItemMeta | None]:
        """Returns once every key is in the EC store: key -> the encoder's metadata (None for
        keys that were already there). Raises StageError."""
        images = dict(items)
        waits = {k: self._inflight[k] for k in images if k in self._inflight}
        present = await self._in_store([k for k in images if k not in waits])
        to_send = []
        for key in images:
            if key in waits or key in present:
                continue
            if key in self._inflight:  # another request started it while we checked the store
                waits[key] = self._inflight[key]
            else:
                to_send.append(key)
        if self.store is not None:
            self.metrics.ec_hits.inc(len(present))
            self.metrics.ec_misses.inc(len(images) - len(present))
        if to_send:
            waits.update(self._start(request_id, [(k, images[k]) for k in to_send], deadline))
        return await self._wait(waits, deadline)

    def _start(
        self, request_id: str, items: list[tuple[str, bytes]], deadline: float
    ) -> dict[str, asyncio.Future[epd_pb2.ItemMeta | None]]:
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key, _ in items}
        self._inflight.update(futures)
        task = asyncio.create_task(self._encode(request_id, items, futures, deadline))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return futures

    async def _wait(
        self, waits: dict[str, asyncio.Future[epd_pb2.ItemMeta | None]], deadline: float
    ) -> dict[str, epd_pb2.ItemMeta | None]:
        if not waits:
            return {}
        try:
            await asyncio.wait_for(
                asyncio.gather(*(asyncio.shield(f) for f in waits.values())), max(0.0, deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            raise StageError("encode", grpc.StatusCode.DEADLINE_EXCEEDED, "the request deadline passed") from None
        return {key: future.result() for key, future in waits.items()}

    async def _encode(
        self,
        request_id: str,
        items: list[tuple[str, bytes]],
        futures: dict[str, asyncio.Future[epd_pb2.ItemMeta | None]],
        deadline: float,
    ) -> None:
        try:
            metas = await self._call_with_retries(request_id, items, deadline)
            for key, future in futures.items():
                future.set_result(metas[key])
        except BaseException as exc:
            error = exc if isinstance(exc, StageError) else StageError("encode", grpc.StatusCode.INTERNAL, repr(exc))
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)
                    future.exception()  # waiters that gave up must not leave it "never retrieved"
            if not isinstance(exc, Exception):
                raise
        finally:
            for key, future in futures.items():
                if self._inflight.get(key) is future:
                    del self._inflight[key]

    async def _call_with_retries(
        self, request_id: str, items: list[tuple[str, bytes]], deadline: float
    ) -> dict[str, epd_pb2.ItemMeta]:
        request = epd_pb2.EncodeRequest(
            request_id=request_id, items=[epd_pb2.EncodeItem(key=k, image=data) for k, data in items]
        )
        tried: list[str] = []
        last: StageError | None = None
        attempts = self.retries + 1
        for attempt in range(attempts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise last or StageError("encode", grpc.StatusCode.DEADLINE_EXCEEDED, "the request deadline passed")
            replica = self._pick(tried, last)
            tried.append(replica.address)
            try:
                async with self.encoders.lease(replica):
                    reply = await replica.stub.Encode(request, timeout=remaining / (attempts - attempt))
                return self._check_reply(reply, items, replica.address)
            except grpc.aio.AioRpcError as exc:
                last = stage_error("encode", exc, replica.address)
                if exc.code() not in RETRYABLE:
                    raise last from None
                self.encoders.mark_failed(replica)
                log.warning("encode attempt %d/%d failed: %s", attempt + 1, attempts, last.message)
        assert last is not None
        raise StageError("encode", last.code, f"{last.detail} ({attempts} attempts)")

    def _pick(self, tried: Collection[str], last: StageError | None):
        try:
            return self.encoders.pick(exclude=tried)
        except StageError as none_left:
            if last is None:
                raise
            raise StageError(
                "encode", last.code, f"{last.detail}; no other replica to retry on: {none_left.detail}"
            ) from None

    def _check_reply(
        self, reply: epd_pb2.EncodeResponse, items: list[tuple[str, bytes]], address: str
    ) -> dict[str, epd_pb2.ItemMeta]:
        keys = [meta.key for meta in reply.items]
        if keys != [key for key, _ in items]:
            raise StageError(
                "encode", grpc.StatusCode.INTERNAL, f"{address} answered for keys {keys}, not the {len(items)} sent"
            )
        if self.store is None:
            self.metrics.ec_hits.inc(sum(m.cached for m in reply.items))
            self.metrics.ec_misses.inc(sum(not m.cached for m in reply.items))
        return {meta.key: meta for meta in reply.items}

    async def _in_store(self, keys: list[str]) -> set[str]:
        if self.store is None or not keys:
            return set()
        store = self.store
        try:
            check = asyncio.to_thread(lambda: {k for k in keys if store.exists(k)})
            return await asyncio.wait_for(check, _STORE_CHECK_TIMEOUT_S)
        except Exception as exc:  # the encoder checks the store itself; sending is only slower
            log.warning("EC store check failed (%r); sending all %d images to the encoder", exc, len(keys))
            return set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
