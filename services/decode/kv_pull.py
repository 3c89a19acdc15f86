"""Pulls a prefilled request's KV from the prefill server that holds it, and releases it there.

One aio channel per prefill address, kept for the life of the process.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from connectors.kv import KVHandoff
from services.common.errors import KVPullError
from services.common.grpc_server import CHANNEL_OPTIONS
from services.decode import metrics
from services.rpc import epd_pb2, epd_pb2_grpc

log = logging.getLogger(__name__)


class KVPuller:
    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._releases: set[asyncio.Task] = set()

    async def pull(self, kv: epd_pb2.KVHandle) -> KVHandoff:
        started = time.perf_counter()
        data = await self._fetch(kv)
        metrics.KV_PULL_SECONDS.observe(time.perf_counter() - started)
        metrics.KV_PULL_BYTES.inc(len(data))
        try:
            return await asyncio.to_thread(KVHandoff.from_bytes, data)
        except ValueError as exc:
            raise KVPullError(f"KV handoff {kv.handoff_id!r} from {kv.address} is unreadable: {exc}") from None

    def release_soon(self, kv: epd_pb2.KVHandle) -> None:
        """Tell the prefill server it may free the blocks; does not delay the caller."""
        task = asyncio.create_task(self._release(kv))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._releases, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    async def _fetch(self, kv: epd_pb2.KVHandle) -> bytes:
        chunks: list[bytes] = []
        size = 0
        call = self._stub(kv.address).PullKV(epd_pb2.PullKVRequest(handoff_id=kv.handoff_id), timeout=self._timeout_s)
        try:
            async for chunk in call:
                size += len(chunk.data)
                if size > kv.nbytes:
                    call.cancel()
                    raise KVPullError(f"KV handoff {kv.handoff_id!r} from {kv.address} exceeds its {kv.nbytes} bytes")
                chunks.append(chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise _pull_error(kv, exc) from None
        if size != kv.nbytes:
            raise KVPullError(f"KV handoff {kv.handoff_id!r} from {kv.address} ended after {size} of {kv.nbytes} bytes")
        return b"".join(chunks)

    async def _release(self, kv: epd_pb2.KVHandle) -> None:
        try:
            await self._stub(kv.address).ReleaseKV(
                epd_pb2.ReleaseKVRequest(handoff_id=kv.handoff_id), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:  # the prefill side's hold timeout frees it anyway
            log.warning("ReleaseKV %s at %s failed: %s %s", kv.handoff_id, kv.address, exc.code().name, exc.details())

    def _stub(self, address: str) -> epd_pb2_grpc.PrefillStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return epd_pb2_grpc.PrefillStub(channel)


def _pull_error(kv: epd_pb2.KVHandle, exc: grpc.aio.AioRpcError) -> KVPullError:
    code = grpc.StatusCode.NOT_FOUND if exc.code() is grpc.StatusCode.NOT_FOUND else grpc.StatusCode.UNAVAILABLE
    return KVPullError(
        f"could not pull KV handoff {kv.handoff_id!r} from the prefill server at {kv.address}: "
        f"{exc.code().name}: {exc.details()}",
        code,
    )
