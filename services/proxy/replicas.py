"""One pool's replicas: a static list or every A record of a DNS name, least-outstanding
picking, and health from grpc.health.v1 probes plus call failures.

A replica is picked only while it is not in its down window (set when a call to it
fails) and its last probe did not fail; one never probed yet counts as usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.proxy.config import PoolSource
from services.proxy.errors import StageError

log = logging.getLogger("epd.proxy")

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
)
_PROBE_TIMEOUT_S = 1.0


@dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: Any
    outstanding: int = 0
    picks: int = 0
    healthy: bool | None = None  # last probe's answer; None until probed
    down_until: float = 0.0  # monotonic; set when a call fails

    def usable(self, now: float) -> bool:
        return now >= self.down_until and self.healthy is not False

    def serving(self, now: float) -> bool:
        return now >= self.down_until and self.healthy is True


@dataclass
class ReplicaSet:
    source: PoolSource
    stub_type: Callable[[grpc.aio.Channel], Any]
    health_interval_s: float = 2.0
    down_s: float = 5.0
    dns_refresh_s: float = 10.0
    replicas: dict[str, Replica] = field(default_factory=dict)
    _retired: list[Replica] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def pool(self) -> str:
        return self.source.pool

    async def start(self) -> None:
        """Resolve and probe once (so /health is right from the start), then keep doing it."""
        await self.refresh_addresses()
        await self.probe_all()
        self._tasks.append(asyncio.create_task(self._every(self.health_interval_s, self.probe_all)))
        if self.source.dns_name:
            self._tasks.append(asyncio.create_task(self._every(self.dns_refresh_s, self.refresh_addresses)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in [*self.replicas.values(), *self._retired]:
            await replica.channel.close()

    # ------------------------------------------------------------------ picking

    def pick(self, exclude: Collection[str] = (), prefer: str | None = None) -> Replica:
        """The usable replica with the fewest outstanding calls (`prefer` first if usable)."""
        now = time.monotonic()
        candidates = [r for r in self.replicas.values() if r.usable(now) and r.address not in exclude]
        if not candidates:
            raise self.no_replica(exclude)
        chosen = next((r for r in candidates if r.address == prefer), None)
        chosen = chosen or min(candidates, key=lambda r: (r.outstanding, r.picks))
        chosen.picks += 1
        return chosen

    @contextlib.asynccontextmanager
    async def lease(self, replica: Replica) -> AsyncIterator[Replica]:
        replica.outstanding += 1
        try:
            yield replica
        finally:
            replica.outstanding -= 1
            if replica in self._retired and replica.outstanding == 0:
                self._retired.remove(replica)
                await replica.channel.close()

    def mark_failed(self, replica: Replica) -> None:
        replica.down_until = time.monotonic() + self.down_s
        replica.healthy = False
        log.warning("%s replica %s failed a call; skipped for %.1fs", self.pool, replica.address, self.down_s)

    def no_replica(self, tried: Collection[str] = ()) -> StageError:
        known = ", ".join(self.replicas) or "none"
        where = f" (resolved from {self.source.describe()})" if self.source.dns_name else ""
        detail = f"; already tried {', '.join(tried)}" if tried else ""
        return StageError(
            self.pool,
            grpc.StatusCode.UNAVAILABLE,
            f"no healthy {self.pool} replica among {known}{where}{detail}",
        )

    def serving_count(self) -> int:
        now = time.monotonic()
        return sum(r.serving(now) for r in self.replicas.values())

    # ------------------------------------------------------------------ health and membership

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))

    async def _probe(self, replica: Replica) -> None:
        stub = health_pb2_grpc.HealthStub(replica.channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_PROBE_TIMEOUT_S)
            replica.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            replica.healthy = False

    async def refresh_addresses(self) -> None:
        addresses = await self._resolve()
        if addresses is None:
            return
        for address in addresses:
            if address not in self.replicas:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                self.replicas[address] = Replica(address, channel, self.stub_type(channel))
        for address in [a for a in self.replicas if a not in addresses]:
            await self._retire(self.replicas.pop(address))

    async def _retire(self, replica: Replica) -> None:
        log.info("%s replica %s left %s", self.pool, replica.address, self.source.describe())
        if replica.outstanding:
            self._retired.append(replica)
        else:
            await replica.channel.close()

    async def _resolve(self) -> list[str] | None:
        """The current addresses; None keeps the old ones (a transient DNS failure)."""
        if not self.source.dns_name:
            return list(self.source.addresses)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                self.source.dns_name, self.source.dns_port, family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_NONAME:  # the name has no records: no replicas now
                return []
            log.warning(
                "resolving %s failed (%s); keeping %d replicas", self.source.describe(), exc, len(self.replicas)
            )
            return None
        return sorted({f"{info[4][0]}:{self.source.dns_port}" for info in infos})

    @staticmethod
    async def _every(interval_s: float, action: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except Exception:  # a background loop must outlive one bad round
                log.exception("background replica task failed")
