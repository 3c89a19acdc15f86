"""One way to run a pool service: grpc.aio server + health + status mapping + metrics + drain.

Life of a process: load the model (in `build`), bind, report SERVING, print the
ready line. On SIGTERM/SIGINT: report NOT_SERVING, stop accepting RPCs, let the
ones in flight finish within --grace-s, close the service's parts, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.common.errors import StatusInterceptor
from services.common.settings import ServerFlags
from services.rpc import epd_pb2

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # images in, KV chunks out
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
log = logging.getLogger(__name__)


def service_name(short: str) -> str:
    """`Prefill` -> `epd.v1.Prefill`, the name health checks use."""
    return epd_pb2.DESCRIPTOR.services_by_name[short].full_name


@dataclass(frozen=True)
class Mounted:
    """What a service puts on the server, and how to close its parts after the drain."""

    services: Sequence[tuple[str, Callable[[grpc.aio.Server], None]]]  # (short name, add_X_to_server)
    close: Callable[[], Awaitable[None]]


def run(label: str, settings: ServerFlags, build: Callable[[], Awaitable[Mounted]]) -> None:
    """Build the service (loads the model), serve until a signal, drain, return (exit 0)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {label} %(levelname)s %(message)s")
    try:
        asyncio.run(_serve(label, settings, build))
    except OSError as exc:  # a port that cannot be bound
        print(f"{label}: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


async def _serve(label: str, settings: ServerFlags, build: Callable[[], Awaitable[Mounted]]) -> None:
    stop = _stop_on_signals()  # from the start: a signal while the model loads still ends cleanly
    mounted = await build()
    server = grpc.aio.server(interceptors=[StatusInterceptor()], options=CHANNEL_OPTIONS)
    health = HealthServicer()
    await health.set("", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for _, add in mounted.services:
        add(server)
    try:
        server.add_insecure_port(settings.bind_address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {settings.bind_address}: {exc}; is the port in use?") from None
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port, addr=settings.host)
    await server.start()
    for name in ("", *(service_name(short) for short, _ in mounted.services)):
        await health.set(name, SERVING)
    print(f"{label} listening on {settings.bind_address}", flush=True)
    await stop.wait()
    log.info("draining: NOT_SERVING, waiting up to %gs for in-flight RPCs", settings.grace_s)
    await health.enter_graceful_shutdown()
    await server.stop(settings.grace_s)
    await mounted.close()
    log.info("stopped")


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
