"""The Prefill and Decode RPCs: replica choice, one failover, deadlines, KV release.

A call moves to one other replica only when the first could not be reached
(UNAVAILABLE before any answer), so the request never ran there. A prefilled KV that
no decode finished with is released on the replica that holds it, in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.proxy.errors import StageError, stage_error
from services.proxy.replicas import Replica, ReplicaSet
from services.rpc import epd_pb2

log = logging.getLogger("epd.proxy")
_RELEASE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Prefilled:
    reply: epd_pb2.PrefillResponse
    replica: Replica  # holds the KV until a decode pulls it or it is released

    @property
    def holds_kv(self) -> bool:
        return not self.reply.finished and bool(self.reply.kv.handoff_id)


class PoolCalls:
    def __init__(self, prefills: ReplicaSet, decodes: ReplicaSet) -> None:
        self.prefills = prefills
        self.decodes = decodes
        self._background: set[asyncio.Task] = set()

    async def prefill(self, request: epd_pb2.PrefillRequest, deadline: float) -> Prefilled:
        request_id, tried = request.request_id, []
        while True:
            replica = self.prefills.pick(exclude=tried)
            tried.append(replica.address)
            try:
                async with self.prefills.lease(replica):
                    reply = await replica.stub.Prefill(request, timeout=time_left(deadline, "prefill"))
                return Prefilled(reply, replica)
            except grpc.aio.AioRpcError as exc:
                self._fail_over_or_raise(self.prefills, replica, exc, tried, "prefill")
                request.request_id = f"{request_id}-p{len(tried)}"

    async def decode(self, request_id: str, prefilled: Prefilled, deadline: float) -> AsyncIterator[epd_pb2.TokenChunk]:
        """The decode stream's chunks; closing this generator early cancels the stream."""
        kv, tried, received = prefilled.reply.kv, [], False
        while True:
            replica = self.decodes.pick(exclude=tried, prefer=kv.address)  # a PD worker keeps its own KV
            tried.append(replica.address)
            try:
                async with self.decodes.lease(replica):
                    request = epd_pb2.DecodeRequest(request_id=request_id, kv=kv)
                    call = replica.stub.Decode(request, timeout=time_left(deadline, "decode"))
                    try:
                        async for chunk in call:
                            received = True
                            yield chunk
                            if chunk.finished:
                                return
                    finally:
                        call.cancel()
                raise StageError("decode", grpc.StatusCode.UNAVAILABLE, f"{replica.address} ended the stream early")
            except grpc.aio.AioRpcError as exc:
                if received:
                    raise stage_error("decode", exc, replica.address) from None
                self._fail_over_or_raise(self.decodes, replica, exc, tried, "decode")

    def _fail_over_or_raise(
        self, pool: ReplicaSet, replica: Replica, exc: grpc.aio.AioRpcError, tried: list[str], stage: str
    ) -> None:
        error = stage_error(stage, exc, replica.address)
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise error from None
        pool.mark_failed(replica)
        if len(tried) > 1:
            raise error from None
        try:
            pool.pick(exclude=tried)
        except StageError:
            raise error from None

    def release_later(self, prefilled: Prefilled) -> None:
        if not prefilled.holds_kv:
            return
        task = asyncio.create_task(self._release(prefilled))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, prefilled: Prefilled) -> None:
        request = epd_pb2.ReleaseKVRequest(handoff_id=prefilled.reply.kv.handoff_id)
        try:
            await prefilled.replica.stub.ReleaseKV(request, timeout=_RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # already pulled and freed
                log.info("releasing KV %s on %s: %s", request.handoff_id, prefilled.replica.address, exc.code())

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)


def time_left(deadline: float, stage: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise StageError(stage, grpc.StatusCode.DEADLINE_EXCEEDED, "the request deadline passed")
    return left
