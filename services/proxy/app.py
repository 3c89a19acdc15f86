"""The proxy process: wires config into the parts, serves HTTP and gRPC, shuts down gracefully."""

from __future__ import annotations

import asyncio
import logging

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from connectors.ec import ECStore, open_ec_store
from services.proxy.config import ConfigError, ProxyConfig
from services.proxy.encode_client import EncodeClient
from services.proxy.grpc_frontend import Frontend
from services.proxy.http_api import HttpApi
from services.proxy.image_fetch import ImageFetcher
from services.proxy.metrics import ProxyMetrics
from services.proxy.openai_format import RequestParser
from services.proxy.pipeline import Pipeline, Pools
from services.proxy.prompts import PromptWorkers
from services.proxy.replicas import ReplicaSet
from services.proxy.request import SamplingDefaults
from services.rpc import epd_pb2, epd_pb2_grpc

log = logging.getLogger("epd.proxy")
_FRONTEND = epd_pb2.DESCRIPTOR.services_by_name["Frontend"].full_name


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.store = _open_store(config.ec_store)
        self.prompts = PromptWorkers(
            config.checkpoint, config.image_limits, config.max_images_per_prompt, config.tokenize_workers
        )
        self.pools = Pools(
            *(
                ReplicaSet(source, stub, config.health_interval_s, config.replica_down_s, config.dns_refresh_s)
                for source, stub in zip(
                    config.pools, (epd_pb2_grpc.EncoderStub, epd_pb2_grpc.PrefillStub, epd_pb2_grpc.DecodeStub)
                )
            )
        )
        self.fetcher = ImageFetcher(config.image_limits.max_bytes, config.image_fetch_timeout_s)
        self.encoder = EncodeClient(self.pools.encoders, self.store, self.metrics, config.encode_retries)
        self.pipeline = Pipeline(config, self.prompts, self.pools, self.encoder, self.metrics, self.fetcher)
        self.parser = RequestParser(
            config.model_name,
            config.max_images_per_prompt,
            config.allow_http_image_urls,
            SamplingDefaults.from_checkpoint(config.checkpoint),
        )
        self.http_port = 0
        self.grpc_port = 0
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        for pool in self.pools:
            await pool.start()
        api = HttpApi(self.config, self.parser, self.pipeline, self.pools, self.metrics)
        # aiohttp reads a timeout <= 0 as "no limit"; gRPC reads grace 0 as "none": keep them the same.
        grace = max(self.config.shutdown_grace_s, 0.001)
        self._runner = web.AppRunner(api.app(), handler_cancellation=True, shutdown_timeout=grace, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.http_port)
        await site.start()
        self.http_port = self._runner.addresses[0][1]
        if self.config.grpc_port:
            await self._start_grpc()
        self._health_task = asyncio.create_task(self._report_health())

    async def _start_grpc(self) -> None:
        limit = self.config.max_body_bytes
        self._grpc = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        epd_pb2_grpc.add_FrontendServicer_to_server(Frontend(self.parser, self.pipeline, self.metrics), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.config.host}:{self.config.grpc_port}")
        if not self.grpc_port:
            raise OSError(f"cannot listen on {self.config.host}:{self.config.grpc_port} for gRPC")
        await self._grpc.start()

    async def _report_health(self) -> None:
        """grpc.health.v1 says what GET /health says: SERVING while every pool has a healthy replica."""
        while True:
            serving = all(pool.serving_count() for pool in self.pools)
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", _FRONTEND):
                await self._health.set(service, status)
            await asyncio.sleep(self.config.health_interval_s)

    def ready_line(self) -> str:
        line = f"epd-proxy listening on http://{self.config.host}:{self.http_port}"
        return line + (f" grpc://{self.config.host}:{self.grpc_port}" if self.grpc_port else "")

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, release everything."""
        if self._health_task:
            self._health_task.cancel()
        await self._health.enter_graceful_shutdown()
        grace = self.config.shutdown_grace_s
        await asyncio.gather(
            self._runner.cleanup() if self._runner else asyncio.sleep(0),
            self._grpc.stop(grace) if self._grpc else asyncio.sleep(0),
        )
        await self.pipeline.close()
        await self.encoder.close()
        await self.fetcher.close()
        for pool in self.pools:
            await pool.close()
        self.prompts.close()
        if self.store is not None:
            self.store.close()


def _open_store(url: str | None) -> ECStore | None:
    if not url:
        return None
    try:
        return open_ec_store(url, max_bytes=2**62)  # only exists() is used: the budget never applies
    except ValueError as exc:
        raise ConfigError(f"--ec-store {url}: {exc}") from None
